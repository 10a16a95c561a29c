"""The chaos scenarios: each starts a fresh cluster (database, Redis, a prefork and a threads
worker with ``-c 2``), runs producer threads and 4 key racer processes x 8 threads while its
faults happen, stops the load when the faults stop, waits until no run is unfinished (at most
``recovery_bound``), and checks the database and the ledger (``checks.py``).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.chaos import faults as f
from tests.chaos.checks import (
    Report,
    Snapshot,
    analyze,
    check_consistency,
    check_sampler,
    check_worked_after,
    describe_runs,
    wait_quiet,
)
from tests.chaos.cluster import Cluster
from tests.chaos.load import KeySampler, Producers, Racers, Start
from tests.pgserver import PgServer

# durable_celery.worker.upkeep: the longest pause of a relay while the broker is down
RELAY_BACKOFF_MAX = 15.0
TERM_WITHIN = 20.0  # seconds past the grace period a warm shutdown may take
WORKED_WITHIN = 30.0  # seconds the load goes on after an outage, at most, until every worker began a step


def recovery_bound(settings: dict[str, Any]) -> float:
    """How long after the faults stop every run must be finished: a lost lock goes stale and is
    swept (``stale_lock_timeout`` + a sweep), the relay sends it (``relay_after``, or its longest
    back-off after a broker outage), plus 30 s for the backlog on two busy cores."""
    return (
        settings["stale_lock_timeout"]
        + 2 * settings["sweep_interval"]
        + settings["relay_after"]
        + RELAY_BACKOFF_MAX
        + 30
    )


Faults = Callable[[Cluster, f.FaultLog, random.Random, float], None]


@dataclass
class Scenario:
    name: str
    faults: Faults
    seconds: float  # how long the load runs while the faults happen
    racer_pause: float = 1.0  # mean seconds between a racer thread's starts (32 threads)
    long_share: float = 0.05  # of the steps that take 2.5 s, longer than the grace period
    rate: float = 2.5  # starts a second from the producer threads
    check: Callable[[Report, f.FaultLog, Snapshot, Cluster, list[Start]], None] | None = None


def _until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.time()))


def _ready(cluster: Cluster) -> None:
    for worker in cluster.workers.values():
        if not worker.alive():
            worker.start()
    for worker in cluster.workers.values():
        worker.wait_ready()


def kills(cluster: Cluster, log: f.FaultLog, rng: random.Random, seconds: float) -> None:
    """Every 2-3 s SIGKILL a pool process (busy if any), a prefork worker's main process alone or
    a whole worker (busy if any), restarting a killed worker; each kind once first, then at random."""
    end = time.time() + seconds
    prefork = tuple(name for name, worker in cluster.workers.items() if worker.pool == "prefork")
    order = ["kill_child", *rng.sample(["kill_parent", "kill_node"], 2)]
    while time.time() + 2 < end:
        _until(time.time() + rng.uniform(2.0, 3.0))
        kind = (
            order.pop(0) if order else rng.choices(("kill_child", "kill_parent", "kill_node"), (2, 1, 1))[0]
        )
        if kind == "kill_node":
            f.kill_node(cluster, log, f.busy_worker(cluster, tuple(cluster.workers), rng, wait=1.5))
        elif kind == "kill_parent":
            f.kill_parent(cluster, log, f.busy_worker(cluster, prefork, rng, wait=1.5))
        else:
            f.kill_child(cluster, log, rng, wait=10.0)
    _ready(cluster)


def check_kills(
    report: Report, log: f.FaultLog, snap: Snapshot, cluster: Cluster, starts: list[Start]
) -> None:
    """Each kind of kill happened: a pool process, a worker parent alone, a whole worker."""
    kinds = {fault.kind for fault in log.faults}
    for kind in ("kill_child", "kill_parent", "kill_node"):
        if kind not in kinds:
            report.problem(f"no {kind} fault happened")
    orphans = [fault.detail["orphans"] for fault in log.faults if fault.kind == "kill_parent"]
    report.counts["pool processes left by a killed worker parent"] = sum(int(n) for n in orphans)  # type: ignore[call-overload]


def rolling_restart(cluster: Cluster, log: f.FaultLog, rng: random.Random, seconds: float) -> None:
    """SIGTERM each worker in turn (warm shutdown), a new one in its place before the next."""
    end = time.time() + seconds
    for name in cluster.workers:
        _until(time.time() + 1)
        # Best while it begins a step longer than the grace period: that one is handed back.
        f.terminate(cluster, log, f.busy_worker(cluster, (name,), rng, wait=10, long_ms=2000, fresh=0.8))
    _until(end)


def redis_restart(cluster: Cluster, log: f.FaultLog, rng: random.Random, seconds: float) -> None:
    """Redis down 3 s; the load goes on until every worker has begun a step after it."""
    end = time.time() + seconds
    _until(time.time() + 3)
    outage = f.redis_outage(cluster, log, down=3.0)
    _until(end)
    f.wait_worked(cluster, outage.t1, WORKED_WITHIN)


def pg_restart(mode: str) -> Faults:
    def restart(cluster: Cluster, log: f.FaultLog, rng: random.Random, seconds: float) -> None:
        """PostgreSQL down 2 s; the load goes on until every worker has begun a step after it."""
        end = time.time() + seconds
        _until(time.time() + 3)
        outage = f.pg_restart(cluster, log, mode, down=2.0)
        _until(end)
        f.wait_worked(cluster, outage.t1, WORKED_WITHIN)

    return restart


def stops(cluster: Cluster, log: f.FaultLog, rng: random.Random, seconds: float) -> None:
    """SIGSTOP each worker in turn while it runs a step, SIGCONT once the step was taken over."""
    end = time.time() + seconds
    for worker in cluster.workers.values():
        _until(time.time() + 1.5)
        f.stop(cluster, log, worker)
    _until(end)


def key_race_faults(cluster: Cluster, log: f.FaultLog, rng: random.Random, seconds: float) -> None:
    """Pool process and worker kills, alternating every 3 s, while the racers race."""
    end = time.time() + seconds
    n = 0
    while time.time() + 2 < end:
        _until(time.time() + 3)
        if n % 2:
            f.kill_node(cluster, log, f.busy_worker(cluster, tuple(cluster.workers), rng, wait=1.5))
        else:
            f.kill_child(cluster, log, rng)
        n += 1
    _ready(cluster)


def check_terms(
    report: Report, log: f.FaultLog, snap: Snapshot, cluster: Cluster, starts: list[Start]
) -> None:
    grace = float(cluster.settings["shutdown_grace_period"])
    terms = [fault for fault in log.faults if fault.kind == "term"]
    if len(terms) != len(cluster.workers):
        report.problem(f"{len(terms)} warm shutdowns for {len(cluster.workers)} workers")
    if not any(entry["kind"] == "handed_back" for entry in snap.activity):
        # The load decides whether a step longer than the grace period is running when a
        # SIGTERM lands (busy_worker waits 10 s for one); when none was, say so. The hand-back
        # itself is proven by tests/e2e (a prefork worker stopped mid-step).
        report.counts["rolling restarts that met no step longer than the grace period"] += 1
    for fault in terms:
        seconds = float(fault.detail["seconds"])  # type: ignore[arg-type]
        if fault.detail["exit"] != 0 or seconds > grace + TERM_WITHIN:
            report.problem(
                f"worker {fault.worker}: SIGTERM, exit {fault.detail['exit']} after {seconds:.1f}s"
            )


def check_fenced(
    report: Report, log: f.FaultLog, snap: Snapshot, cluster: Cluster, starts: list[Start]
) -> None:
    """Every step a stopped worker held when it was stopped, and that another worker took over
    (a stale take-back), left a ``worker_fenced`` entry: its result was dropped. (A held run that
    a newer start cancelled meanwhile is not taken over: its step just stops.)"""
    held = {rid for fault in log.faults if fault.kind == "stop" for rid in fault.detail["held"]}  # type: ignore[union-attr]
    if not held:
        report.problem("no stopped worker held a step: nothing was fenced")
    taken = {entry["run_id"] for entry in snap.activity if entry["kind"] == "stale_recovered"} & held
    fenced = {entry["run_id"] for entry in snap.activity if entry["kind"] == "worker_fenced"}
    for rid in sorted(taken - fenced):
        report.problem(f"run {rid}: taken over from a stopped worker, but no worker_fenced entry")
    report.counts["stopped steps taken over"] = len(taken)
    # Under load every held run may have been replaced by a newer start (cancel_existing) before
    # the stale sweep's turn: those are not taken over, and prove nothing either way.
    cancelled = {rid for rid in held if (snap.runs.get(rid) or {}).get("status") == "cancelled"}
    report.counts["stopped steps cancelled by a newer start"] = len(cancelled - taken)
    if held - cancelled and not taken:
        report.problem("no step of a stopped worker was taken over")


def check_broker_outage(
    report: Report, log: f.FaultLog, snap: Snapshot, cluster: Cluster, starts: list[Start]
) -> None:
    """Starts went on while Redis was down, and every worker saw the loss, lived, and began steps
    after Redis was back (it reconnected by itself)."""
    (outage,) = [fault for fault in log.faults if fault.kind == "redis"]
    check_worked_after(report, snap, cluster.workers, outage.t1, "the Redis outage")
    during = [rec for rec in starts if outage.t0 <= rec.t0 <= outage.t1]
    report.counts["starts while Redis was down"] = len(during)
    if not during:
        report.problem("no start was made while Redis was down")
    for worker in cluster.workers.values():
        if "Connection to broker lost" not in worker.log_path.read_text(errors="replace"):
            report.problem(f"worker {worker.name} did not notice that Redis went away")


def check_database_outage(
    report: Report, log: f.FaultLog, snap: Snapshot, cluster: Cluster, starts: list[Start]
) -> None:
    """Some starts were refused (DatabaseUnavailable) during the outage and went through when
    tried again; every worker began steps after the outage (it reconnected by itself). (The
    consistency query of every scenario finds nothing half-written.)"""
    (outage,) = [fault for fault in log.faults if fault.kind.startswith("pg_")]
    check_worked_after(report, snap, cluster.workers, outage.t1, "the PostgreSQL outage")
    refused = [rec for rec in starts if rec.errors]
    report.counts["starts refused, then retried"] = len(refused)
    if not refused:
        report.problem("no start met the database outage")
    for rec in refused:
        if rec.outcome not in ("ok", "key_taken", "contended"):
            report.problem(f"a start refused during the outage ended {rec.outcome} when tried again")


SCENARIOS = {
    "kill": Scenario("kill", kills, 14.0, check=check_kills),
    "sigterm": Scenario("sigterm", rolling_restart, 10.0, long_share=0.3, rate=1.5, check=check_terms),
    "redis": Scenario("redis", redis_restart, 10.0, check=check_broker_outage),
    "pg_fast": Scenario("pg_fast", pg_restart("fast"), 9.0, check=check_database_outage),
    "pg_immediate": Scenario("pg_immediate", pg_restart("immediate"), 9.0, check=check_database_outage),
    "sigstop": Scenario("sigstop", stops, 6.0, check=check_fenced),
    "keys": Scenario("keys", key_race_faults, 10.0, racer_pause=0.25),
}


def run(scenario: Scenario, pg: PgServer, folder: Path, seed: int = 0, **settings: Any) -> Report:
    """Run one scenario on a fresh cluster; its report (``report.check()`` raises on problems)."""
    cluster = Cluster(pg, folder / scenario.name, scenario.name, settings=settings)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(cluster.close)
        began = time.monotonic()
        cluster.launch()
        assert cluster.client is not None
        log, rng = f.FaultLog(), random.Random(seed)
        racers = Racers(cluster.worker_env(), cluster.folder, pause=scenario.racer_pause)
        cleanup.callback(racers.kill)
        racers.start()
        cluster.wait_ready()
        sampler = KeySampler(cluster.url).start()
        cleanup.callback(sampler.stop)
        producers = Producers(
            cluster.client, seed, rate=scenario.rate, long_share=scenario.long_share
        ).start()
        cleanup.callback(producers.abort)
        racers.go()
        scenario.faults(cluster, log, rng, scenario.seconds)
        starts: list[Start] = producers.stop() + racers.stop()
        bound = recovery_bound(cluster.settings)
        recovery, _left = wait_quiet(cluster.connect, bound)
        sampler.stop()
        report = Report(scenario.name, recovery=recovery, bound=bound)
        for worker in cluster.workers.values():
            if not worker.alive():
                report.problem(f"worker {worker.name} exited by itself:\n{worker.log_tail()}")
        with cluster.connect() as conn:
            snap = analyze(conn, report, starts, log)
            check_consistency(conn, report)
        check_sampler(sampler, report)
        if scenario.check is not None:
            scenario.check(report, log, snap, cluster, starts)
        report.counts["scenario s"] = round(time.monotonic() - began)
        (cluster.folder / "faults.txt").write_text("\n".join(map(repr, log.faults)))
        if report.problems:
            with cluster.connect() as conn:
                runs = describe_runs(conn, "\n".join(report.problems))
            (cluster.folder / "problems.txt").write_text("\n".join([*report.problems, "", runs]))
            kept = Path(tempfile.mkdtemp(prefix=f"durable-chaos-{scenario.name}-"))
            shutil.copytree(cluster.folder, kept, dirs_exist_ok=True)  # pytest's tmp_path rotates
            report.logs = f"{cluster.logs()}\nlogs and problems kept in {kept}"
        return report
    raise AssertionError("unreachable")  # for type checkers: the with block returns
