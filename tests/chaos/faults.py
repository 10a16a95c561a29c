"""What the chaos scenarios do to the cluster, each logged with its time and the processes it
hit, so that every extra step execution can be matched to the fault that caused it.

| kind | what |
|---|---|
| ``kill_child`` | SIGKILL to one prefork pool process (preferably one running a step) |
| ``kill_parent`` | SIGKILL to a prefork worker's main process alone, its pool processes orphaned |
| ``kill_node`` | SIGKILL to a whole worker (its process group), then a new worker in its place |
| ``term`` | SIGTERM to a worker (warm shutdown, grace period), then a new one in its place |
| ``stop`` | SIGSTOP to a worker running a step until another worker took the step over, SIGCONT |
| ``redis`` | Redis killed (SIGKILL, no persistence) and started again on its port |
| ``pg_fast``, ``pg_immediate`` | PostgreSQL stopped with ``-m fast`` / ``-m immediate``, started again |
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import psycopg

from tests.chaos.cluster import Cluster, Worker, group_pids

# A step lost this way runs again without using an attempt: the whole worker went.
NODE_FAULTS = ("kill_node", "kill_parent", "term", "stop")
ORPHANS_REAPED_AFTER = 0.5  # seconds a killed worker parent's pool processes are left before they are reaped
# What a fault causes is written within this window around it: a sweep of a lost lock comes
# ``stale_lock_timeout`` (4 s) + a sweep after the last heartbeat, a fenced result or a hand-back
# sooner; 15 s leaves room for a starved CPU. A sweep may also come up to 1 s *before* the kill of
# a pool process that was already starved (docs/reliability.md, "Timing under a starved CPU").
CAUSED_BEFORE = 1.0
CAUSED_WITHIN = 15.0


@dataclass
class Fault:
    """One fault: its kind, the worker and processes it hit, and from when to when (epoch s):
    ``t0`` when it struck, ``t1`` when it was over (the same for a kill; SIGCONT for a stop, the
    exit for a warm shutdown, the reaping of the orphans for a parent kill)."""

    kind: str
    t0: float
    t1: float
    worker: str | None = None
    pids: tuple[int, ...] = ()
    detail: dict[str, object] = field(default_factory=dict)

    def hit(
        self, pid: int, began: float, done: float | None, run_id: str | None = None, fence: int | None = None
    ) -> bool:
        """Was an execution in process ``pid``, begun at ``began`` and done at ``done`` (None:
        never), in progress while this struck: begun by ``t1`` and not done before ``t0``? (A
        stopped worker's step may write its ledger row only after SIGCONT: it is known by its
        run and fencing token.) A fault hits a whole process, so every thread of it."""
        if pid not in self.pids:
            return False
        held = self.detail.get("held")
        if isinstance(held, dict) and run_id in held and held[run_id] == fence:
            return True
        return began <= self.t1 and (done is None or done >= self.t0)

    def caused(self, pid: int, at: float) -> bool:
        """Could an entry naming ``pid`` written at ``at`` (a sweep, a fenced result, a hand-back)
        come from this fault: from ``CAUSED_BEFORE`` s before it to ``CAUSED_WITHIN`` s after?"""
        return pid in self.pids and self.t0 - CAUSED_BEFORE <= at <= self.t1 + CAUSED_WITHIN


class FaultLog:
    """Every fault of a scenario, in order (thread-safe)."""

    def __init__(self) -> None:
        self.faults: list[Fault] = []
        self._lock = threading.Lock()

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def explaining(
        self,
        pid: int,
        began: float,
        done: float | None,
        run_id: str | None = None,
        fence: int | None = None,
        kinds: tuple[str, ...] | None = None,
    ) -> Fault | None:
        """The first fault (of ``kinds``) that hit the execution of ``pid`` begun at ``began`` and
        done at ``done`` while it was in progress (``Fault.hit``)."""
        with self._lock:
            for fault in self.faults:
                if (kinds is None or fault.kind in kinds) and fault.hit(pid, began, done, run_id, fence):
                    return fault
        return None

    def causing(self, pid: int, at: float, kinds: tuple[str, ...]) -> Fault | None:
        """The first fault of ``kinds`` that may have caused an entry naming ``pid`` at ``at``."""
        with self._lock:
            return next((f for f in self.faults if f.kind in kinds and f.caused(pid, at)), None)

    def count(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for fault in self.faults:
            counts[fault.kind] = counts.get(fault.kind, 0) + 1
        return counts


def _locks(
    cluster: Cluster, pids: list[int], long_ms: int = 0, fresh: float = 0.0
) -> list[tuple[str, int, int]]:
    """Runs locked now by one of ``pids``: (run id, pid, fence). With ``long_ms``, only in a step
    of that many ms or more; with ``fresh``, only one that began less than ``fresh`` s ago."""
    query = (
        "SELECT r.id, r.locked_by, r.fence FROM durable_runs r WHERE r.locked_by IS NOT NULL "
        "AND coalesce((r.input->'ms'->>r.step_index)::int, 0) >= %s"
    )
    args: tuple[object, ...] = (long_ms,)
    if fresh:
        query += (
            " AND EXISTS (SELECT 1 FROM chaos_ledger l WHERE l.run_id = r.id AND l.fence = r.fence"
            " AND l.phase = 'begin' AND l.at >= %s)"
        )
        args += (time.time() - fresh,)
    try:
        with cluster.connect() as conn:
            rows = conn.execute(query, args)
            found = [(rid, int(locked_by.split(":")[-2]), fence) for rid, locked_by, fence in rows]
    except psycopg.OperationalError:
        return []
    return [lock for lock in found if lock[1] in pids]


def held_runs(cluster: Cluster, pids: list[int]) -> dict[str, int]:
    """Runs locked now by one of ``pids``: run id -> fence."""
    return {rid: fence for rid, _pid, fence in _locks(cluster, pids)}


def busy_worker(
    cluster: Cluster,
    names: tuple[str, ...],
    rng: random.Random,
    wait: float = 5.0,
    long_ms: int = 0,
    fresh: float = 0.0,
) -> Worker:
    """One of the workers ``names`` running a step now (see ``_locks`` for ``long_ms`` and
    ``fresh``), waiting up to ``wait`` seconds for one (a fault on an idle worker tests little);
    any of them if none is by then."""
    workers = [cluster.workers[name] for name in names]
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        pids = {w.name: set(w.pids()) for w in workers}
        held = {
            pid for _rid, pid, _fence in _locks(cluster, [p for ps in pids.values() for p in ps], long_ms)
        }
        busy = [w for w in workers if held & pids[w.name]]
        if busy:
            return rng.choice(busy)
        time.sleep(0.05)
    return rng.choice(workers)


def kill_child(cluster: Cluster, log: FaultLog, rng: random.Random, wait: float = 0.0) -> Fault | None:
    """SIGKILL one pool process of a prefork worker, one running a step if there is one (waiting
    up to ``wait`` s for a prefork worker that is settled, e.g. one just restarted)."""
    deadline = time.monotonic() + wait
    prefork = [w for w in cluster.workers.values() if w.pool == "prefork" and w.settled()]
    while not prefork and time.monotonic() < deadline:
        time.sleep(0.1)
        prefork = [w for w in cluster.workers.values() if w.pool == "prefork" and w.settled()]
    if not prefork:
        return None
    worker = rng.choice(prefork)
    children = worker.children()
    if not children:
        return None
    locks = _locks(cluster, children)
    victim = rng.choice(sorted({pid for _rid, pid, _fence in locks}) or children)
    at = time.time()
    os.kill(victim, signal.SIGKILL)
    held = {rid: fence for rid, pid, fence in locks if pid == victim}
    return log.add(Fault("kill_child", at, at, worker.name, (victim,), {"held": held}))


def kill_node(cluster: Cluster, log: FaultLog, worker: Worker, restart: bool = True) -> Fault:
    """SIGKILL a whole worker; start a new one in its place (not waiting for it)."""
    pids = tuple(worker.pids())
    at = time.time()
    worker.kill()
    fault = log.add(Fault("kill_node", at, at, worker.name, pids))
    if restart:
        worker.start()
    return fault


def kill_parent(cluster: Cluster, log: FaultLog, worker: Worker, restart: bool = True) -> Fault:
    """SIGKILL only a worker's main process (as the OOM killer might), leaving its pool processes
    orphaned; after ``ORPHANS_REAPED_AFTER`` s kill whatever is left of its process group, as a
    supervisor would, and start a new worker in its place (not waiting for it)."""
    pids = tuple(worker.pids())
    at = time.time()
    os.kill(worker.pid, signal.SIGKILL)
    assert worker.proc is not None
    worker.proc.wait(30)
    time.sleep(ORPHANS_REAPED_AFTER)
    orphans = group_pids(worker.pid)  # pool processes still alive (Celery's parent-death signal kills them)
    worker.kill()
    fault = log.add(Fault("kill_parent", at, time.time(), worker.name, pids, {"orphans": len(orphans)}))
    if restart:
        worker.start()
    return fault


def terminate(cluster: Cluster, log: FaultLog, worker: Worker, patience: float = 60.0) -> Fault:
    """SIGTERM a worker (warm shutdown: running steps get the grace period, then are handed
    back); wait for it to exit, start a new one and wait until it is ready."""
    pids = tuple(worker.pids())
    at = time.time()
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGTERM)
    try:
        code: int | None = worker.proc.wait(patience)
    except Exception:  # it did not stop in time: that is the finding, and the node must go
        code = None
        worker.kill()
    ended = time.time()
    worker.close()
    fault = log.add(Fault("term", at, ended, worker.name, pids, {"exit": code, "seconds": ended - at}))
    worker.start()
    worker.wait_ready()
    return fault


def stop(cluster: Cluster, log: FaultLog, worker: Worker, tries: int = 20) -> Fault | None:
    """SIGSTOP a worker while it runs a step, keep it stopped until another worker has taken
    that step over (past ``stale_lock_timeout``), then SIGCONT: its result must be fenced."""
    stale = float(cluster.settings["stale_lock_timeout"])
    for _ in range(tries):
        deadline = time.monotonic() + 10
        while not held_runs(cluster, worker.pids()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = worker.pids()
        at = time.time()
        worker.signal_group(signal.SIGSTOP)
        held = held_runs(cluster, pids)
        if held:
            _wait_taken_over(cluster, held, stale * 3 + 20)
            worker.signal_group(signal.SIGCONT)
            fault = Fault("stop", at, time.time(), worker.name, tuple(pids), {"held": held})
            return log.add(fault)
        worker.signal_group(signal.SIGCONT)  # it held nothing at that instant: try again
        log.add(Fault("stop", at, time.time(), worker.name, tuple(pids), {"held": {}}))
    return None


def _wait_taken_over(cluster: Cluster, held: dict[str, int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with cluster.connect() as conn:
            rows = conn.execute(
                "SELECT id, fence, status FROM durable_runs WHERE id = ANY(%s)", (list(held),)
            )
            if all(
                fence > held[rid] or status in ("completed", "failed", "cancelled")
                for rid, fence, status in rows
            ):
                return
        time.sleep(0.1)
    raise AssertionError(f"no worker took over the steps of the stopped worker within {seconds:.0f}s: {held}")


def redis_outage(cluster: Cluster, log: FaultLog, down: float = 3.0) -> Fault:
    """Kill Redis (SIGKILL, no persistence), leave it down ``down`` seconds, start it again."""
    at = time.time()
    cluster.broker.kill()
    time.sleep(down)  # the outage itself
    cluster.broker.start()
    return log.add(Fault("redis", at, time.time(), detail={"down": down}))


def wait_worked(cluster: Cluster, since: float, seconds: float) -> None:
    """Wait (the load going on) until every worker has begun a step after ``since``, at most
    ``seconds``: the outage checks want each worker's own work after it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with cluster.connect() as conn:
                query = "SELECT DISTINCT worker FROM chaos_ledger WHERE phase = 'begin' AND at > %s"
                if {row[0] for row in conn.execute(query, (since,))} >= set(cluster.workers):
                    return
        except psycopg.OperationalError:
            pass
        time.sleep(0.3)


def pg_restart(cluster: Cluster, log: FaultLog, mode: str, down: float = 2.0) -> Fault:
    """Stop PostgreSQL with ``pg_ctl -m <mode>``, leave it down ``down`` seconds, start it."""
    at = time.time()
    cluster.pg.stop(mode=mode)
    time.sleep(down)  # the outage itself
    cluster.pg.start()
    return log.add(Fault(f"pg_{mode}", at, time.time(), detail={"down": down}))
