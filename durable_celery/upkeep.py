"""Periodic upkeep inside every worker: the outbox relay (relay.py), the stale-lock sweep,
workflow timeouts, missed wake-ups, pruning, queue samples, the node's heartbeat row and its
consumers of paused queues.

Any number of nodes can run it: the relay and the pruner take their rows with ``FOR UPDATE SKIP
LOCKED``, the sweeps end each run with an update that only matches while it is still stale or
overdue, and one node at a time writes a queue sample.

Three threads keep their own time, so no pass can starve another: the relay (which backs off
while the broker is down), the sweeper (timeouts, the node's heartbeat, stale locks) and
housekeeping (pruning, samples, the activity trim). The sweeper treats a lock as stale only
after it has seen the database for ``stale_lock_timeout`` without a break: after an outage the
healthy workers heartbeat their steps again before anything of theirs is handed back.
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from celery import bootsteps
from celery.exceptions import WorkerShutdown
from sqlalchemy import Connection

from . import prune, queues, signals
from .app_argument import app_argument as _app_argument
from .capabilities import Capability
from .keys import end_run_txn
from .nodes import Node
from .observe import ACTIVITY_KEPT
from .relay import RELAY_BATCH, BrokerDown, relay_once
from .schedules import restore_schedules_once
from .store import activity_rows, child_rows, doctor_rows, node_rows, queries
from .store.db import utcnow

if TYPE_CHECKING:
    from .app import Durable

log = logging.getLogger("durable_celery")

__all__ = ["relay_once", "sweep_stale_once", "Upkeep", "install"]

TRIM_INTERVAL = 3600.0
RELAY_BACKOFF_MAX = 15.0  # the longest wait between relay passes while the broker is down
SAMPLE_INTERVAL = 60.0
STOP_WAIT = 10.0  # the longest stop() waits for each thread's current pass (a query that hangs)


def sweep_stale_once(durable: Durable) -> tuple[list[str], list[str]]:
    """Hand back runs whose worker vanished; fail those lost too often. Returns both lists."""
    s, db = durable.settings, durable.db
    error = {
        "type": "WorkerLost",
        "message": f"the run's worker was lost {s.max_losses} times during one step",
        "traceback": None,
    }
    handed_back: list[str] = []
    failed: list[str] = []
    with db.engine.connect() as conn:
        stale = queries.stale_runs(db, conn, s.stale_lock_timeout, RELAY_BATCH)
    for run in stale:
        lost_for_good = run.losses + 1 >= s.max_losses
        fail_with = error if lost_for_good else None

        def take_back(conn: Connection, run: Any = run, fail_with: Any = fail_with) -> bool:
            if not queries.take_back_stale_txn(db, conn, run, s.stale_lock_timeout, fail_with):
                return False
            details = {"locked_by": run.locked_by, "losses": run.losses + 1, "failed": fail_with is not None}
            activity_rows.record_txn(db, conn, "stale_recovered", run.id, run.workflow, run.key, details)
            return True

        if lost_for_good:
            ended = "compensation_failed" if run.status == "compensating" else "failed"
            if _end(durable, run, ended, take_back):
                failed.append(run.id)
            continue
        with db.begin() as conn:
            if take_back(conn):
                handed_back.append(run.id)
    if handed_back or failed:  # the relay sends the handed-back runs at its next pass
        log.warning("durable: recovered %d stale run(s), failed %d", len(handed_back), len(failed))
        signals.stale_recovered.send(sender=durable, run_ids=handed_back, failed_ids=failed)
    return handed_back, failed


def wake_missed_once(durable: Durable) -> int:
    """Make due the waiting runs whose event is kept for them (or whose children all finished)
    but that were never woken; returns how many. A safety net: the wake-up is normally sent in
    the same transaction as the event."""
    db = durable.db
    with db.engine.connect() as conn:
        missed = doctor_rows.missed_wakeups(conn, RELAY_BATCH)
    woken = 0
    for row in missed:
        with db.begin() as conn:
            woken += doctor_rows.wake_missed_txn(db, conn, row.id)
    if woken:
        log.warning("durable: woke %d waiting run(s) that missed their wake-up", woken)
    return woken


def cancel_orphans_once(durable: Durable) -> list[str]:
    """Cancel unfinished children of cancelled parents (a cancel whose process died before it
    reached every child); returns their ids."""
    from .control import cancel

    with durable.db.engine.connect() as conn:
        orphans = child_rows.orphans(conn, RELAY_BATCH)
    cancelled = [row.id for row in orphans if cancel(durable, row.id)]
    if cancelled:
        log.warning("durable: cancelled %d child run(s) of cancelled parents", len(cancelled))
    return cancelled


def fail_overdue_once(durable: Durable) -> list[str]:
    """Fail runs past their workflow timeout; returns their ids."""
    db = durable.db
    with db.engine.connect() as conn:
        overdue = queries.overdue_runs(db, conn, RELAY_BATCH)
    failed = []
    for run in overdue:
        timeout = getattr(durable.workflows.get(run.workflow), "timeout", None)
        error = {
            "type": "WorkflowTimeout",
            "traceback": None,
            "message": f"the run did not finish within its timeout of {timeout}s",
        }

        def fail(conn: Connection, run: Any = run, error: Any = error) -> bool:
            return queries.fail_overdue_txn(db, conn, run.id, error)

        if _end(durable, run, "failed", fail):
            failed.append(run.id)
    return failed


def _end(durable: Durable, run: Any, status: str, end: Any) -> bool:
    """Finish one run in its own transaction, keeping the key rules; True if it was ended."""
    with durable.db.begin() as conn:
        done, settled = end_run_txn(durable, conn, run, status, end)
    if done:
        signals.run_finished.send(sender=durable, run_id=run.id, workflow=run.workflow, status=status)
    if settled is not None:
        settled.after_commit(durable)
    return done


def sample_queues_once(durable: Durable) -> bool:
    """Write this minute's per-queue sample unless another node did; True if this one wrote."""
    return queues.sample_once(durable, SAMPLE_INTERVAL)


def trim_activity_once(durable: Durable) -> int:
    """Delete activity entries older than a week; returns how many."""
    with durable.db.begin() as conn:
        return activity_rows.trim_txn(conn, utcnow() - ACTIVITY_KEPT)


class Upkeep:
    """The upkeep threads of one worker (relay, sweeper, housekeeping), run until stopped."""

    def __init__(self, durable: Durable, worker: Any = None) -> None:
        self.durable = durable
        self.node = Node(durable, worker) if worker is not None else None
        self.worker = worker
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._failing: set[str] = set()  # jobs failing now: logged once per outage
        # Since when this node has seen the database without a break (None: it is away now).
        self.db_seen_since: float | None = -math.inf

    def start(self) -> None:
        """Start the threads (once)."""
        if any(t.is_alive() for t in self._threads):
            return
        self._stop.clear()
        self._threads = [
            threading.Thread(target=loop, name=f"durable-{name}", daemon=True)
            for name, loop in (
                ("relay", self._relay_loop),
                ("sweeper", self._sweep_loop),
                ("housekeeping", self._housekeeping_loop),
            )
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop the threads and wait for their current passes."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=STOP_WAIT)

    def _wait(self, seconds: float) -> bool:
        # Jittered: a pass in step with a stream of starts on one key (each locks its holder's
        # row for a moment) would keep finding that row locked and skipping it.
        return self._stop.wait(seconds * random.uniform(0.75, 1.25))

    def _relay_loop(self) -> None:
        s = self.durable.settings
        self._guarded(self._register_node)
        delay = s.poll_interval
        self._note_task_events()
        while not self._wait(delay):
            self._note_task_events()
            self._guarded(self._reconcile_queues)
            try:
                self._guarded(relay_once, raising=(BrokerDown,))
                delay = s.poll_interval
            except BrokerDown as exc:  # back off: an outage must not tie up the relay
                if delay == s.poll_interval:
                    log.warning("durable relay: %s; trying again with growing pauses", exc)
                delay = min(max(delay, 0.5) * 2, max(RELAY_BACKOFF_MAX, s.poll_interval))

    def _note_task_events(self) -> None:
        """Tell this worker's processes whether it sends task events (``-E``, or Flower's
        ``enable_events``): inline steps send theirs then (continuation.py)."""
        dispatcher = getattr(getattr(self.worker, "consumer", None), "event_dispatcher", None)
        if dispatcher is None:  # the consumer has not started yet: keep what the options said
            return
        groups = getattr(dispatcher, "groups", None)
        on = bool(getattr(dispatcher, "enabled", False)) and (not groups or "task" in groups)
        self.durable.engine.task_events.value = int(on)

    def _sweep_loop(self) -> None:
        s = self.durable.settings
        next_sweep = time.monotonic() + min(s.sweep_interval, s.stale_lock_timeout)
        next_beat = time.monotonic()
        while not self._wait(s.poll_interval):
            self._observe(self._guarded(fail_overdue_once) is not None)  # a list, even if empty
            now = time.monotonic()
            if self.node is not None and now >= next_beat:
                next_beat = now + max(s.heartbeat_interval, 1.0)
                self._guarded(self._beat_node)
            if now >= next_sweep:
                next_sweep = now + s.sweep_interval
                if self.may_sweep_stale():
                    self._guarded(sweep_stale_once)
                self._guarded(cancel_orphans_once)
                self._guarded(wake_missed_once)
                self._guarded(restore_schedules_once)

    def _housekeeping_loop(self) -> None:
        s = self.durable.settings
        next_trim = next_prune = next_sample = time.monotonic()
        while not self._wait(s.poll_interval):
            now = time.monotonic()
            if s.prune and now >= next_prune:
                # A batch per rule per pass, so a large backlog never holds up the others: the
                # next pass goes on with it while more is left.
                more = self._guarded(prune.prune_some)
                next_prune = now if more else now + s.prune_interval
            if now >= next_sample:
                next_sample = now + SAMPLE_INTERVAL
                self._guarded(sample_queues_once)
            if now >= next_trim:
                next_trim = now + TRIM_INTERVAL
                self._guarded(trim_activity_once)

    def _observe(self, reached: bool) -> None:
        """Note whether the sweeper's last pass reached the database."""
        if not reached:
            self.db_seen_since = None
        elif self.db_seen_since is None:
            self.db_seen_since = time.monotonic()
            log.warning(
                "durable: the database is back; stale locks are swept once it has been seen for %.0fs",
                self.durable.settings.stale_lock_timeout,
            )

    def may_sweep_stale(self) -> bool:
        """Has this node seen the database for ``stale_lock_timeout`` without a break? Only then
        can it tell a silent worker from one that could not reach the database either."""
        since = self.db_seen_since
        return since is not None and time.monotonic() - since >= self.durable.settings.stale_lock_timeout

    def _register_node(self, durable: Durable) -> None:
        if self.node is not None:
            self.node.register()

    def mark_draining(self, durable: Durable) -> None:
        """Show this node as draining (``durable nodes``, ``status``) while it shuts down."""
        if self.node is not None:
            with durable.db.begin() as conn:
                node_rows.mark_draining(conn, self.node.name)

    def _beat_node(self, durable: Durable) -> None:
        if self.node is not None:
            self.node.beat()

    def _reconcile_queues(self, durable: Durable) -> None:
        if self.node is not None:
            self.node.reconcile(queues.paused_queues(durable))

    def _guarded(self, job: Any, raising: tuple[type[BaseException], ...] = ()) -> Any:
        """Run one job; an error (the database may be restarting) is logged once until the job
        works again, and the next pass tries again. Returns None when it failed."""
        name = getattr(job, "__name__", str(job))
        try:
            result = job(self.durable)
        except raising:
            raise
        except Exception:
            if name in self._failing:
                log.debug("durable upkeep: %s still failing", name, exc_info=True)
            else:
                self._failing.add(name)
                log.exception("durable upkeep: %s failed (logged once until it works again)", name)
            return None
        if name in self._failing:
            self._failing.discard(name)
            log.warning("durable upkeep: %s works again", name)
        return result


def refuse_old_schema(durable: Durable) -> None:
    """Stop a starting worker whose database is behind this code's schema (exit code 1), with
    one line naming the pending revisions and the command that applies them."""
    if durable.db.bad_url is not None:  # no database at all can be reached with this URL
        log.critical("durable: %s", durable.db.bad_url)
        print(f"durable: {durable.db.bad_url}", file=sys.stderr, flush=True)
        raise WorkerShutdown(1)
    try:
        pending = durable.pending_migrations()
    except Exception as exc:  # the database is away: the worker starts and waits for it
        log.error("durable: could not check the database schema at start (%s)", str(exc).splitlines()[0])
        return
    if pending:
        message = (
            f"durable: the database schema is behind this code (pending revisions: {', '.join(pending)}); "
            f"run `celery -A {_app_argument()} durable migrate`, then start this worker again"
        )
        log.critical(message)
        print(message, file=sys.stderr, flush=True)
        raise WorkerShutdown(1)


def refuse_forking_pool(durable: Durable, worker: Any) -> None:
    """Stop a starting worker whose pool forks processes when the store is one process only
    (the in-memory store): each pool process would see a copy of its own."""
    from celery.concurrency.prefork import TaskPool as ForkingPool

    if Capability.MULTI_PROCESS in durable.capabilities:
        return
    if not isinstance(getattr(worker, "pool", None), ForkingPool):
        return
    message = (
        f"durable: the {durable.db.masked_url} store is one process only (missing MULTI_PROCESS): "
        "start this worker with --pool threads (or solo), or give Durable a database URL"
    )
    log.critical(message)
    print(message, file=sys.stderr, flush=True)
    raise WorkerShutdown(1)


def install(durable: Durable) -> None:
    """Run upkeep inside every worker of ``durable.app`` (a worker bootstep)."""

    class DurableUpkeep(bootsteps.StartStopStep):
        """Durable's schema check, relay, waker and stale-lock sweep, started and stopped with
        the worker."""

        requires = ("celery.worker.components:Pool",)

        def create(self, worker: Any) -> Upkeep | None:
            durable.engine.worker_pid = os.getpid()  # before the pool forks: drain() from a child
            # Task events on from the start (-E): inline steps send theirs from the first one.
            sends = getattr(worker, "task_events", None) or worker.app.conf.worker_send_task_events
            durable.engine.task_events.value = int(bool(sends))
            return Upkeep(durable, worker) if durable.settings.upkeep else None

        def start(self, worker: Any) -> None:
            refuse_forking_pool(durable, worker)
            refuse_old_schema(durable)
            durable.engine.undrain()
            super().start(worker)

        def stop(self, worker: Any) -> None:
            # Steps stop in reverse order: the consumer has stopped taking work, the pool
            # (stopped after this) waits for running steps; those still running after the
            # grace period are handed back.
            durable.engine.drain(durable.settings.shutdown_grace_period)
            upkeep = getattr(self, "obj", None)
            if upkeep is not None:
                upkeep._guarded(upkeep.mark_draining)
            super().stop(worker)

        def terminate(self, worker: Any) -> None:
            # A cold shutdown: no grace period, but the node is leaving all the same, so other
            # nodes stop counting on its code at once (rollout.py) and its queues' consumers.
            upkeep = getattr(self, "obj", None)
            if upkeep is not None:
                upkeep._guarded(upkeep.mark_draining)
            super().terminate(worker)

    durable.app.steps["worker"].add(DurableUpkeep)
