"""The long soak: ``python -m tests.chaos --minutes 10``.

One cluster (a prefork and a threads worker that take every fault, and a threads worker
``steady`` that only lives through the server outages), pruning on, producer threads and key
racers the whole time, and a fault every ``--fault-every`` seconds, cycling through every kind
in a random order. Runs are checked as they finish (before pruning deletes them; a trigger
keeps the id and status of every run pruned, so one pruned before its check is still accounted
for) and their ledger rows dropped; at the end the load stops, every run must finish within the
recovery bound, every start not checked yet is checked, and every id a start returned that is
neither checked, pruned nor present is lost. ``ledger_atomic`` runs (tests/chaos/atomic.py) go
on beside them the whole time and are checked at the end: one ledger row per completed run, none
for another, balances that add up (``atomic_checks.check_soak_ledger``). It prints the chaos
table line, worker RSS growth and table / dead-tuple growth.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos import faults as f
from tests.chaos.atomic import LedgerLoad
from tests.chaos.atomic_checks import check_soak_ledger
from tests.chaos.atomic_workflows import ATOMIC, PLAIN, TABLES_DDL
from tests.chaos.checks import (
    UNFINISHED,
    Report,
    analyze,
    check_consistency,
    check_sampler,
    table,
    wait_quiet,
)
from tests.chaos.cluster import Cluster, chaos_server
from tests.chaos.load import KeySampler, Producers, Racers, Start
from tests.chaos.scenarios import recovery_bound

WORKERS = (("a", "prefork"), ("b", "threads"), ("steady", "threads"))
FAULTED = ("a", "b")  # workers the node faults pick from; "steady" keeps its process for RSS
PREFORK = ("a",)  # the one a parent-only kill picks
PRUNE = {"prune": {"completed": 90, "cancelled": 90, "failed": 90}, "prune_interval": 15.0}
CHECK_EVERY = 15.0  # seconds between checks of the runs finished since
SETTLED = 20.0  # a run is checked once it finished this long ago (its fenced executions are in)
TABLES = ("durable_runs", "durable_steps", "durable_keys", "durable_activity", "durable_events")
FAULT_KINDS = ("kill_child", "kill_parent", "kill_node", "term", "stop", "redis", "pg_fast", "pg_immediate")
ATOMIC_RATE = 1.0  # starts a second of ledger_atomic runs (tests/chaos/atomic.py), checked at the end
CHAOS_RUNS = f"workflow NOT IN ('{ATOMIC}', '{PLAIN}')"  # the runs the periodic checks take
# Every run pruned (deleted), with its status: a run pruned before it was checked is not lost.
PRUNED_DDL = """
CREATE TABLE chaos_pruned (id text PRIMARY KEY, status text NOT NULL, key text, workflow text);
CREATE FUNCTION chaos_record_pruned() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_pruned SELECT id, status, key, workflow FROM pruned ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_pruned AFTER DELETE ON durable_runs REFERENCING OLD TABLE AS pruned
    FOR EACH STATEMENT EXECUTE FUNCTION chaos_record_pruned();
"""


@dataclass
class Soak:
    """The soak's state: its cluster, load, fault log, report and samples."""

    cluster: Cluster
    rng: random.Random
    report: Report
    log: f.FaultLog = field(default_factory=f.FaultLog)
    checked: dict[str, str | None] = field(default_factory=dict)  # run id -> key, checked or pruned
    checked_starts: set[tuple[str, float]] = field(default_factory=set)
    rss: dict[int, list[tuple[float, str, int]]] = field(default_factory=dict)
    tables: list[tuple[float, dict[str, tuple[int, int, int]]]] = field(default_factory=list)
    cycle: list[str] = field(default_factory=list)

    def fault(self) -> str:
        """Do the next fault; returns what it was."""
        if not self.cycle:  # every kind once per cycle, in a random order
            self.cycle = self.rng.sample(FAULT_KINDS, len(FAULT_KINDS))
        kind = self.cycle.pop()
        names = PREFORK if kind == "kill_parent" else FAULTED
        worker = f.busy_worker(self.cluster, names, self.rng) if kind in f.NODE_FAULTS else None
        if kind == "kill_child":
            f.kill_child(self.cluster, self.log, self.rng, wait=10.0)
        elif worker is not None and kind == "kill_parent":
            f.kill_parent(self.cluster, self.log, worker)
        elif worker is not None and kind == "kill_node":
            f.kill_node(self.cluster, self.log, worker)
        elif worker is not None and kind == "term":
            f.terminate(self.cluster, self.log, worker)
        elif worker is not None and kind == "stop":
            f.stop(self.cluster, self.log, worker)
        elif kind == "redis":
            f.redis_outage(self.cluster, self.log, down=self.rng.uniform(2, 6))
        else:
            f.pg_restart(self.cluster, self.log, kind.removeprefix("pg_"), down=self.rng.uniform(1, 4))
        return f"{kind} {worker.name}" if worker is not None else kind

    def check(self, starts: list[Start], final: bool = False) -> int:
        """Check the runs finished since the last check (every run, and every start not checked
        yet, when ``final``); returns how many runs."""
        with self.cluster.connect() as conn:
            self._pruned(conn)
            if final:
                rows = conn.execute(
                    f"SELECT id, input->>'tag' FROM durable_runs WHERE {CHAOS_RUNS}"
                ).fetchall()
            else:
                settled = "finished_at < now() - %s * interval '1 second'"
                query = f"SELECT id, input->>'tag' FROM durable_runs WHERE {settled} AND {CHAOS_RUNS}"
                rows = conn.execute(query, (SETTLED,))
                rows = rows.fetchall()
            fresh = [(rid, tag) for rid, tag in rows if rid not in self.checked]
            ids, tags = {rid for rid, _ in fresh}, {tag for _, tag in fresh}
            mine = [
                s
                for s in starts
                if (s.tag, s.t0) not in self.checked_starts
                and (final or s.run_id in ids or s.holder in ids or s.tag in tags)
            ]
            snap = analyze(conn, self.report, mine, self.log, sorted(ids), earlier=self.checked)
            conn.execute("DELETE FROM chaos_ledger WHERE run_id = ANY(%s)", (sorted(ids),))
        self.checked.update({rid: run["key"] for rid, run in snap.runs.items()})
        self.checked_starts |= {(s.tag, s.t0) for s in mine}
        return len(ids)

    def _pruned(self, conn: Any) -> None:
        """Account for the runs pruned before they were checked: finished (else a problem), their
        executions unchecked (counted)."""
        rows = conn.execute(f"SELECT id, status, key FROM chaos_pruned WHERE {CHAOS_RUNS}").fetchall()
        self.report.counts["runs pruned"] = len(rows)
        missed = [(rid, status, key) for rid, status, key in rows if rid not in self.checked]
        for rid, status, key in missed:
            self.checked[rid] = key
            self.report.counts["runs pruned before they were checked"] += 1
            self.report.started += 1
            self.report.completed += status == "completed"
            self.report.failed += status == "failed"
            self.report.cancelled += status == "cancelled"
            if status in UNFINISHED:
                self.report.problem(f"run {rid} was pruned while {status}")
        conn.execute("DELETE FROM chaos_ledger WHERE run_id = ANY(%s)", ([rid for rid, _, _ in missed],))

    def sample(self) -> None:
        """Worker RSS per process, and rows, dead tuples and bytes per table."""
        now = time.time()
        for worker in self.cluster.workers.values():
            for pid, kb in worker.rss().items():
                self.rss.setdefault(pid, []).append((now, worker.name, kb))
        with self.cluster.connect() as conn:
            sizes = {}
            for table_name in TABLES:
                (rows,) = conn.execute(f"SELECT count(*) FROM {table_name}").fetchone()
                stats = "SELECT n_dead_tup, pg_total_relation_size(relid) FROM pg_stat_user_tables"
                dead, size = conn.execute(f"{stats} WHERE relname = %s", (table_name,)).fetchone()
                sizes[table_name] = (rows, dead, size)
        self.tables.append((now, sizes))


def rss_growth(soak: Soak, began: float, minutes: float) -> list[str]:
    """RSS at the first sample a minute in, and at the end, of every process that lived through
    at least half the soak."""
    lines = []
    for pid, samples in sorted(soak.rss.items()):
        warm = [s for s in samples if s[0] >= samples[0][0] + 60] or samples
        lived = samples[-1][0] - samples[0][0]
        if lived < minutes * 30 or len(warm) < 2:
            continue
        (t0, name, kb0), (t1, _, kb1) = warm[0], warm[-1]
        marks = [samples[0][0] + 60 * n for n in range(1, int(lived // 60) + 1)]
        series = [min(samples, key=lambda s, at=at: abs(s[0] - at))[2] / 1024 for at in marks]  # type: ignore[misc]
        lines.append(
            f"  {name:<7} pid {pid:<7} {kb0 / 1024:6.1f} MiB -> {kb1 / 1024:6.1f} MiB "
            f"({(kb1 - kb0) / 1024:+.1f} MiB over {(t1 - t0) / 60:.1f} min); "
            f"each minute: {' '.join(f'{mib:.0f}' for mib in series)}"
        )
    return lines or ["  (no process lived through half the soak)"]


def table_growth(soak: Soak) -> list[str]:
    """Rows, dead tuples and size of each table a minute in, at its largest, and at the end."""
    warm = [t for t in soak.tables if t[0] >= soak.tables[0][0] + 60] or soak.tables
    first, last = warm[0][1], warm[-1][1]
    lines = [f"  {'table':<18}{'rows':>16}{'max rows':>10}{'dead tuples':>16}{'size KiB':>20}"]
    for name in TABLES:
        top = max(sample[1][name][0] for sample in warm)
        rows = f"{first[name][0]} -> {last[name][0]}"
        dead = f"{first[name][1]} -> {last[name][1]}"
        size = f"{first[name][2] // 1024} -> {last[name][2] // 1024}"
        lines.append(f"  {name:<18}{rows:>16}{top:>10}{dead:>16}{size:>20}")
    return lines


def progress(soak: Soak, began: float, producers: Producers, last_fault: str) -> str:
    with soak.cluster.connect() as conn:
        query = "SELECT count(*) FROM durable_runs WHERE status = ANY(%s)"
        (unfinished,) = conn.execute(query, (list(UNFINISHED),)).fetchone()
    r = soak.report
    minutes, seconds = divmod(int(time.time() - began), 60)
    return (
        f"[{minutes:02d}:{seconds:02d}] producer starts {len(producers.starts)}, "
        f"runs checked {len(soak.checked)} "
        f"(completed {r.completed}, failed {r.failed}, cancelled {r.cancelled}), unfinished {unfinished}, "
        f"executions {r.executions}, extra {r.explained}/{r.unexplained}, faults {len(soak.log.faults)} "
        f"(last: {last_fault}), problems {len(r.problems)}"
    )


def soak(minutes: float, fault_every: float, seed: int, folder: Path | None = None) -> Report:
    """Run the soak; prints progress and the figures, returns the report."""
    folder = folder or Path(tempfile.mkdtemp(prefix="durable-chaos-soak-"))
    print(
        f"soak: {minutes} min, a fault every ~{fault_every:.0f} s, seed {seed}, logs in {folder}", flush=True
    )
    with chaos_server() as pg:
        cluster = Cluster(pg, folder, "soak", WORKERS, settings=PRUNE)
        try:
            return _soak(cluster, minutes, fault_every, seed)
        finally:
            cluster.close()


def _soak(cluster: Cluster, minutes: float, fault_every: float, seed: int) -> Report:
    rng = random.Random(seed)
    cluster.start()
    assert cluster.client is not None
    with cluster.connect() as conn:
        conn.execute(PRUNED_DDL)
        conn.execute(TABLES_DDL)
    run = Soak(cluster, rng, Report("soak"))
    racers = Racers(cluster.worker_env(), cluster.folder, minutes * 60 + 600, pause=2.0).start()
    began = time.time()
    end = began + minutes * 60
    sampler = KeySampler(cluster.url, interval=0.5).start()
    producers = Producers(cluster.client, seed).start()
    ledger = LedgerLoad(cluster.client, ATOMIC, seed, ATOMIC_RATE, runs=10**9).start()
    racers.go()
    next_fault, next_check, next_note, last = began + fault_every, began + CHECK_EVERY, began + 10, "none"
    try:
        while time.time() < end:
            now = time.time()
            if now >= next_fault:
                last = run.fault()
                next_fault = time.time() + fault_every * rng.uniform(0.75, 1.25)
            if now >= next_check:
                run.check(producers.starts + racers.read())
                run.sample()
                next_check = time.time() + CHECK_EVERY
            if now >= next_note:
                print(progress(run, began, producers, last), flush=True)
                next_note = now + 10
            time.sleep(0.2)
        for worker in cluster.workers.values():
            if not worker.alive():
                worker.start()
        starts = producers.stop() + racers.stop()
        ledger.stop()
        bound = recovery_bound(cluster.settings)
        run.report.recovery, _ = wait_quiet(cluster.connect, bound)
        run.report.bound = bound
        sampler.stop()
        run.sample()
        run.check(starts, final=True)
        with cluster.connect() as conn:
            check_consistency(conn, run.report)
            check_soak_ledger(conn, run.report, ledger.inputs, run.log)
        check_sampler(sampler, run.report)
        for worker in cluster.workers.values():
            if not worker.alive():
                run.report.problem(f"worker {worker.name} exited by itself:\n{worker.log_tail()}")
    finally:
        racers.kill()
    print(progress(run, began, producers, last))
    print()
    print(table([run.report]))
    print("worker RSS (processes that lived through half the soak or more):")
    print("\n".join(rss_growth(run, began, minutes)))
    print(f"tables (pruning on: {PRUNE['prune']} s, every {PRUNE['prune_interval']} s):")
    print("\n".join(table_growth(run)))
    if run.report.problems:
        print(f"\n{len(run.report.problems)} problem(s):")
        print("\n".join(f"  {p}" for p in run.report.problems[:40]))
    return run.report


def main(argv: Any = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos",
        description="Soak durable_celery under mixed faults: workers killed, stopped and restarted, "
        "Redis and PostgreSQL restarted, keys raced; checks every run and step execution.",
        epilog="python -m tests.chaos atomic --help: the atomic-step scenario (tests/chaos/atomic.py).",
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the load and faults run (10)")
    parser.add_argument("--fault-every", type=float, default=20.0, help="seconds between faults, about (20)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a random one)")
    parser.add_argument("--folder", type=Path, default=None, help="where worker logs go (a temp folder)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    report = soak(args.minutes, args.fault_every, seed, args.folder)
    return 1 if report.problems else 0
