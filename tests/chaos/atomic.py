"""The atomic-step scenario: a ledger booked once per completed run, under faults.

One cluster runs two loads side by side (``LedgerLoad``): runs of ``ledger_atomic``, whose
``book`` step is ``atomic=True``, and of its twin ``ledger_plain``, the same workflow without
``atomic`` (``atomic_workflows.py``). Each run's input says its account, amount and hold,
whether it fails, and whether and when it is cancelled (``cancel_in``). The faults
(``ledger_faults``), each kind once per cycle in a random order, 1-2.5 s apart: a pool process
SIGKILLed while it runs ``book`` of ``ledger_atomic`` past its writes, and another while it runs
``book`` of ``ledger_plain`` past its writes (so the twin surely books a run twice), a whole
worker SIGKILLed and a worker SIGSTOPped past ``stale_lock_timeout`` (taken over, then
SIGCONT) while it runs ``book`` of ``ledger_atomic`` past its writes, a PostgreSQL restart and a
Redis restart. The checks (``atomic_checks.py``), for each workflow: one ledger row per
completed run and none for any other, balances that add up, every extra execution of ``book``
explained by a fault. ``ledger_atomic`` must pass them all; ``ledger_plain`` must pass all but
the ledger's, and must book some run twice.

The test (tests/chaos/test_chaos_atomic.py) runs one cycle; ``python -m tests.chaos atomic
--minutes 10`` runs cycles for that long (``main``).
"""

from __future__ import annotations

import contextlib
import heapq
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from durable_celery import DatabaseUnavailable, Durable
from tests.chaos import faults as f
from tests.chaos.atomic_checks import check_ledger_scenario
from tests.chaos.atomic_workflows import ATOMIC, BOOK, PLAIN, TABLES_DDL, new_ledger_input
from tests.chaos.checks import Report, check_consistency, describe_runs, table, wait_quiet
from tests.chaos.cluster import Cluster, Worker, chaos_server
from tests.chaos.load import RETRY_FOR, Start, start_one
from tests.chaos.scenarios import _ready, _until, recovery_bound
from tests.chaos.workflows import RETRY
from tests.pgserver import PgServer


@dataclass
class Cancel:
    """One cancel the load made: when it was asked, and what it returned or raised."""

    run_id: str
    at: float = 0.0
    result: bool | None = None
    errors: list[str] = field(default_factory=list)


class LedgerLoad:
    """Starts runs of ``workflow`` at ``rate`` a second (``runs`` at most) until ``stop()``, and
    cancels those whose input says so, ``cancel_in`` seconds after their start."""

    def __init__(
        self, client: Durable, workflow: str, seed: int, rate: float, runs: int, cancel_share: float = 0.2
    ) -> None:
        """The load, not started yet."""
        self.client, self.workflow, self.rate, self.runs = client, workflow, rate, runs
        self.rng = random.Random(seed)
        self.cancel_share = cancel_share
        self.starts: list[Start] = []
        self.inputs: dict[str, dict[str, Any]] = {}  # run id -> its input
        self.cancels: dict[str, Cancel] = {}
        self._due: list[tuple[float, str]] = []  # (when, run id) of the cancels to make
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._threads = [
            threading.Thread(target=self._start_runs, daemon=True),
            threading.Thread(target=self._cancel_runs, daemon=True),
        ]

    def start(self) -> LedgerLoad:
        """Start the starting and the cancelling threads."""
        for thread in self._threads:
            thread.start()
        return self

    def _start_runs(self) -> None:
        """Start runs at the pace asked, noting when each is to be cancelled."""
        while not self._stop.is_set() and len(self.starts) < self.runs:
            data = new_ledger_input(self.rng, self.cancel_share)
            rec = start_one(self.client, self.workflow, data, None, None, self._abort)
            with self._lock:
                self.starts.append(rec)
                if rec.run_id is not None:
                    self.inputs[rec.run_id] = data
                    if data["cancel_in"] is not None:
                        heapq.heappush(self._due, (rec.t1 + data["cancel_in"], rec.run_id))
            self._stop.wait(max(0.0, 1 / self.rate - (rec.t1 - rec.t0)))

    def _cancel_runs(self) -> None:
        """Cancel each run due, until the starts are over and no cancel is left."""
        while True:
            over = self._stop.is_set() and not self._threads[0].is_alive()  # no start to come
            with self._lock:
                due = self._due[0] if self._due else None
                if due is not None and due[0] <= time.time():
                    heapq.heappop(self._due)
            if due is None:
                if over:
                    return
                time.sleep(0.05)
            elif due[0] > time.time():
                time.sleep(min(0.05, due[0] - time.time()))
            else:
                self.cancels[due[1]] = self._cancel(due[1])

    def _cancel(self, run_id: str) -> Cancel:
        """Cancel as a careful caller does: try again while the database is unavailable."""
        rec = Cancel(run_id, at=time.time())
        while True:
            try:
                rec.result = self.client.cancel(run_id)
                return rec
            except DatabaseUnavailable as exc:
                rec.errors.append(str(exc))
                if time.time() - rec.at > RETRY_FOR or self._abort.is_set():
                    return rec
                time.sleep(0.3)

    def stop(self) -> list[Start]:
        """No more starts; wait until every cancel planned has been made."""
        self._stop.set()
        for thread in self._threads:
            thread.join(RETRY_FOR + 30)
        return self.starts

    def abort(self) -> None:
        """Stop at once, giving up starts and cancels the database refuses (the scenario failed)."""
        self._abort.set()
        self.stop()


# Runs in ``book`` past their writes, with at least ``margin`` s of their hold left, that no
# cancel will cut short and that will not raise: a fault now makes the step run again after its
# writes. (run id, node, fence)
MID_BOOK = """
SELECT r.id, r.locked_by, r.fence FROM durable_runs r
JOIN chaos_ledger w ON w.run_id = r.id AND w.fence = r.fence AND w.step = %(book)s AND w.phase = 'wrote'
WHERE r.workflow = %(workflow)s AND r.status = 'running' AND r.step_index = %(book)s
  AND r.locked_by IS NOT NULL AND r.input->>'fail' = 'never' AND r.input->'cancel_in' = 'null'
  AND w.at + (r.input->>'hold')::int / 1000.0 > %(until)s
  AND NOT EXISTS (
      SELECT 1 FROM chaos_ledger e WHERE e.run_id = r.id AND e.fence = r.fence AND e.phase IN ('end', 'done'))
"""


def mid_book(
    cluster: Cluster, workflow: str, workers: list[Worker], wait: float, margin: float = 0.4
) -> tuple[Worker, int, dict[str, int]] | None:
    """A worker of ``workers`` running ``book`` past its writes (``MID_BOOK``), waiting up to
    ``wait`` s for one: (worker, the process running it, run id -> fence)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        params = {"book": BOOK, "workflow": workflow, "until": time.time() + margin}
        try:
            with cluster.connect() as conn:
                found = conn.execute(MID_BOOK, params).fetchall()
        except psycopg.OperationalError:
            found = []
        for rid, locked_by, fence in found:
            pid = int(locked_by.split(":")[-2])
            for worker in workers:
                if worker.alive() and pid in worker.pids():
                    return worker, pid, {rid: fence}
        time.sleep(0.05)
    return None


TARGET_WAIT = 10.0  # seconds a targeted fault waits for a step past its writes


def kill_child_mid_book(cluster: Cluster, log: f.FaultLog, rng: random.Random, workflow: str) -> None:
    """SIGKILL a prefork pool process running ``book`` of ``workflow`` past its writes (any busy
    one if none comes within ``TARGET_WAIT`` s)."""
    deadline = time.monotonic() + TARGET_WAIT
    prefork = [w for w in cluster.workers.values() if w.pool == "prefork"]
    while not all(w.settled() for w in prefork) and time.monotonic() < deadline:
        time.sleep(0.1)  # Celery exits when a pool process dies while the pool is starting
    found = mid_book(cluster, workflow, prefork, max(0.0, deadline - time.monotonic()))
    if found is None:
        fault = f.kill_child(cluster, log, rng)
        if fault is not None:
            fault.detail.update({"targeted": False, "workflow": workflow})
        return
    worker, pid, held = found
    at = time.time()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    detail = {"held": held, "targeted": True, "workflow": workflow}
    log.add(f.Fault("kill_child", at, at, worker.name, (pid,), detail))


def kill_node_mid_book(cluster: Cluster, log: f.FaultLog, rng: random.Random, workflow: str) -> None:
    """SIGKILL a whole worker running ``book`` past its writes (a busy one if none comes)."""
    found = mid_book(cluster, workflow, list(cluster.workers.values()), TARGET_WAIT)
    worker = found[0] if found else f.busy_worker(cluster, tuple(cluster.workers), rng, wait=1.5)
    fault = f.kill_node(cluster, log, worker)
    fault.detail.update(
        {"held": found[2] if found else {}, "targeted": found is not None, "workflow": workflow}
    )


def stop_mid_book(cluster: Cluster, log: f.FaultLog, rng: random.Random, workflow: str) -> None:
    """SIGSTOP a worker running ``book`` past its writes until another worker has taken the
    step over (past ``stale_lock_timeout``), then SIGCONT (a busy one if none comes)."""
    found = mid_book(cluster, workflow, list(cluster.workers.values()), TARGET_WAIT, margin=0.6)
    worker = found[0] if found else f.busy_worker(cluster, tuple(cluster.workers), rng, wait=1.5)
    fault = f.stop(cluster, log, worker)
    if fault is not None:
        held = fault.detail["held"]
        fault.detail["targeted"] = found is not None and isinstance(held, dict) and set(found[2]) <= set(held)
        fault.detail["workflow"] = workflow


# Each kind once per cycle: (name, what it does).
FAULTS: dict[str, Callable[[Cluster, f.FaultLog, random.Random], Any]] = {
    "kill_child": lambda c, log, rng: kill_child_mid_book(c, log, rng, ATOMIC),
    "kill_child_plain": lambda c, log, rng: kill_child_mid_book(c, log, rng, PLAIN),
    "kill_node": lambda c, log, rng: kill_node_mid_book(c, log, rng, ATOMIC),
    "stop": lambda c, log, rng: stop_mid_book(c, log, rng, ATOMIC),
    "pg": lambda c, log, rng: f.pg_restart(c, log, rng.choice(("fast", "immediate")), down=2.0),
    "redis": lambda c, log, rng: f.redis_outage(c, log, down=2.5),
}


def ledger_faults(
    cluster: Cluster,
    log: f.FaultLog,
    rng: random.Random,
    seconds: float = 0.0,
    note: Callable[[str], None] | None = None,
) -> None:
    """Cycles of ``FAULTS``, each kind once per cycle in a random order, 1-2.5 s apart, until
    ``seconds`` have passed (one cycle at least); then every worker is up and ready. ``note``
    hears each fault done."""
    end, done = time.time() + seconds, 0
    while True:
        for kind in rng.sample(list(FAULTS), len(FAULTS)):
            _until(time.time() + rng.uniform(1.0, 2.5))
            FAULTS[kind](cluster, log, rng)
            done += 1
            if note is not None:
                note(f"fault {done}: {kind}")
        if time.time() >= end:
            break
    _ready(cluster)


@dataclass
class LedgerScenario:
    """The loads of the atomic scenario: starts a second of each workflow."""

    name: str = "atomic"
    rate: float = 2.0  # starts a second of ledger_atomic, and as many of ledger_plain
    cancel_share: float = 0.2
    seconds: float = 0.0  # how long the faults go on (0: one cycle)


@dataclass
class LedgerOutcome:
    """What the scenario came to: a report per workflow, and the twin's ledger violations."""

    atomic: Report
    plain: Report
    plain_violations: list[str]


PLAIN_DUPLICATES = "runs booked in an execution that did not complete, and run again after a fault"


def run_ledger(
    scenario: LedgerScenario,
    pg: PgServer,
    folder: Path,
    seed: int = 0,
    note: Callable[[str], None] | None = None,
) -> LedgerOutcome:
    """Run the scenario on a fresh cluster; ``report.check()`` of ``atomic`` raises on its
    problems, of ``plain`` on all but the ledger's (``plain_violations``, expected)."""
    cluster = Cluster(pg, folder / scenario.name, scenario.name)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(cluster.close)
        began = time.monotonic()
        cluster.launch()
        assert cluster.client is not None
        with cluster.connect() as conn:
            conn.execute(TABLES_DDL)
        cluster.wait_ready()
        log, rng = f.FaultLog(), random.Random(seed)
        loads = {
            workflow: LedgerLoad(
                cluster.client, workflow, seed + n, scenario.rate, 10**9, scenario.cancel_share
            )
            for n, workflow in enumerate((ATOMIC, PLAIN))
        }
        for load in loads.values():
            cleanup.callback(load.abort)
            load.start()
        _until(time.time() + 1.0)
        ledger_faults(cluster, log, rng, scenario.seconds, note)
        starts = {workflow: load.stop() for workflow, load in loads.items()}
        # A run whose book always declines spends up to (RETRY - 1) back-offs on its last
        # attempts, which may begin only once the relay sent a message a Redis kill lost.
        bound = recovery_bound(cluster.settings) + (RETRY - 1) * cluster.settings["backoff_max"]
        if note is not None:
            note(f"faults over, {sum(map(len, starts.values()))} starts; waiting for every run to end")
        recovery, _left = wait_quiet(cluster.connect, bound)
        reports = {
            w: Report(name, recovery=recovery, bound=bound)
            for w, name in ((ATOMIC, scenario.name), (PLAIN, f"{scenario.name}_off"))
        }
        for worker in cluster.workers.values():
            if not worker.alive():
                reports[ATOMIC].problem(f"worker {worker.name} exited by itself:\n{worker.log_tail()}")
        with cluster.connect() as conn:
            check_consistency(conn, reports[ATOMIC])  # every run of both, once
            violations = {
                w: check_ledger_scenario(
                    conn, reports[w], w, starts[w], loads[w].inputs, loads[w].cancels, log
                )
                for w in (ATOMIC, PLAIN)
            }
        if not violations[PLAIN] or not reports[PLAIN].counts[PLAIN_DUPLICATES]:
            reports[ATOMIC].problem(
                f"{PLAIN} (not atomic) booked no run twice after a fault under the same faults "
                f"({len(violations[PLAIN])} violations): the checks may miss what they look for"
            )
        for report in reports.values():
            report.counts["scenario s"] = round(time.monotonic() - began)
        _keep(
            cluster,
            log,
            scenario.name,
            [*reports[ATOMIC].problems, *reports[PLAIN].problems],
            reports.values(),
        )
        return LedgerOutcome(reports[ATOMIC], reports[PLAIN], violations[PLAIN])
    raise AssertionError("unreachable")  # for type checkers: the with block returns


def _keep(cluster: Cluster, log: f.FaultLog, name: str, problems: list[str], reports: Any) -> None:
    """Write the faults; with problems, keep the logs and problems in a folder of their own."""
    (cluster.folder / "faults.txt").write_text("\n".join(map(repr, log.faults)))
    if not problems:
        return
    with cluster.connect() as conn:
        runs = describe_runs(conn, "\n".join(problems))
    (cluster.folder / "problems.txt").write_text("\n".join([*problems, "", runs]))
    kept = Path(tempfile.mkdtemp(prefix=f"durable-chaos-{name}-"))
    shutil.copytree(cluster.folder, kept, dirs_exist_ok=True)  # pytest's tmp_path rotates
    for report in reports:
        if report.problems:
            report.logs = f"{cluster.logs()}\nlogs and problems kept in {kept}"


def main(argv: Any = None) -> int:
    """``python -m tests.chaos atomic``: the scenario for longer, with progress; 1 on problems."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos atomic",
        description="Atomic steps under faults: ledger_atomic and its twin ledger_plain (atomic=False) "
        "book a ledger while pool processes and workers are killed mid-step, a worker is stopped and "
        "taken over mid-step, and PostgreSQL and Redis restart, in cycles; then every completed run must "
        "have booked once (ledger_atomic) and the twin must have booked some run twice.",
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="how long the faults go on (5)")
    parser.add_argument("--rate", type=float, default=2.0, help="starts a second of each workflow (2)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a random one)")
    parser.add_argument("--folder", type=Path, default=None, help="where worker logs go (a temp folder)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="durable-chaos-atomic-"))
    print(f"atomic: {args.minutes} min of fault cycles, seed {seed}, logs in {folder}", flush=True)
    began = time.time()

    def note(text: str) -> None:
        """Print a progress line (after each fault, and once the faults are over)."""
        minutes, seconds = divmod(int(time.time() - began), 60)
        print(f"[{minutes:02d}:{seconds:02d}] {text}", flush=True)

    scenario = LedgerScenario("atomic", rate=args.rate, seconds=args.minutes * 60)
    with chaos_server() as pg:
        outcome = run_ledger(scenario, pg, folder, seed, note)
    print()
    print(table([outcome.atomic, outcome.plain]))
    print(f"\n{PLAIN}: {len(outcome.plain_violations)} ledger violations (expected), e.g.:")
    print("\n".join(f"  {violation}" for violation in outcome.plain_violations[:5]))
    problems = [*outcome.atomic.problems, *outcome.plain.problems]
    if problems:
        print(f"\n{len(problems)} problem(s):")
        print("\n".join(f"  {p}" for p in problems[:40]))
    return 1 if problems else 0
