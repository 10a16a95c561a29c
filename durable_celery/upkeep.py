"""Periodic upkeep inside every worker: the outbox relay and waker, the stale-lock sweep,
pruning, queue samples, the node's heartbeat row and its consumers of paused queues.

Any number of nodes can run it: the relay and the pruner take their rows with ``FOR UPDATE SKIP
LOCKED``, the sweeps end each run with an update that only matches while it is still stale or
overdue, and one node at a time writes a queue sample.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import TYPE_CHECKING, Any

from celery import bootsteps
from sqlalchemy import Connection

from . import prune, queues, signals
from .keys import end_run_txn
from .nodes import Node
from .observe import ACTIVITY_KEPT
from .rollout import defer, fail_changed, known_elsewhere
from .store import activity_rows, child_rows, doctor_rows, node_rows, queries, queue_rows
from .store.db import utcnow
from .store.schema import runs

if TYPE_CHECKING:
    from .app import Durable

log = logging.getLogger("durable_celery")

RELAY_BATCH = 500
TRIM_INTERVAL = 3600.0
SAMPLE_INTERVAL = 60.0


def relay_once(durable: Durable) -> int:
    """Send every due run's message (new, woken or lost); returns how many were sent."""
    known = list(durable.workflows)
    if not known:
        return 0
    sent = 0
    while True:
        with durable.db.begin() as conn:
            rows = queries.take_due_runs_txn(
                durable.db,
                conn,
                durable.settings.relay_after,
                RELAY_BATCH,
                runs.c.workflow.in_(known),
                ~queue_rows.paused_exists(),  # a paused queue's runs wait for its resume
            )
        for row in rows:
            workflow = durable.workflows[row.workflow]
            if not _has_step(workflow, row.step_index, row.step_name):
                # newer code elsewhere (a rolling deploy), or the step was renamed or removed
                if row.step_name is not None and known_elsewhere(durable, row.workflow, row.step_name):
                    defer(durable, row.id, row.workflow, row.step_name, row.step_index)
                else:
                    fail_changed(durable, row.id, row.workflow, row.step_name, row.step_index)
            else:
                compensate = row.status == "compensating"
                sent += durable.publish(
                    workflow, row.step_index, row.id, row.attempt, row.key, compensate=compensate
                )
        if len(rows) < RELAY_BATCH:
            return sent


def _has_step(workflow: Any, index: int, name: str | None) -> bool:
    if index >= len(workflow.steps):
        return False
    return name is None or workflow.steps[index].name == name


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
            return queries.take_back_stale_txn(db, conn, run, s.stale_lock_timeout, fail_with)

        if lost_for_good:
            ended = "compensation_failed" if run.status == "compensating" else "failed"
            if _end(durable, run, ended, take_back):
                failed.append(run.id)
            continue
        with db.begin() as conn:
            if take_back(conn):
                handed_back.append(run.id)
    if handed_back or failed:
        log.warning("durable: recovered %d stale run(s), failed %d", len(handed_back), len(failed))
        signals.stale_recovered.send(sender=durable, run_ids=handed_back, failed_ids=failed)
        relay_once(durable)
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


def check_schema(durable: Durable) -> list[str]:
    """Log an error when the database is behind this code's schema; returns the pending
    revisions. Migrate before starting workers of new code."""
    pending = durable.pending_migrations()
    if pending:
        log.error(
            "durable: the database schema is behind this code (pending revisions: %s); "
            "run `celery -A <app> durable migrate` before starting these workers",
            ", ".join(pending),
        )
    return pending


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
    """A daemon thread running the periodic passes until stopped."""

    def __init__(self, durable: Durable, worker: Any = None) -> None:
        self.durable = durable
        self.node = Node(durable, worker) if worker is not None else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="durable-upkeep", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for its current pass."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        s = self.durable.settings
        next_sweep = time.monotonic() + min(s.sweep_interval, s.stale_lock_timeout)
        next_trim = next_prune = next_sample = next_beat = time.monotonic()
        self._guarded(check_schema)
        self._guarded(self._register_node)
        # Jittered: a pass in step with a stream of starts on one key (each locks its holder's
        # row for a moment) would keep finding that row locked and skipping it.
        while not self._stop.wait(s.poll_interval * random.uniform(0.75, 1.25)):
            self._guarded(self._reconcile_queues)
            self._guarded(relay_once)
            self._guarded(fail_overdue_once)
            now = time.monotonic()
            if self.node is not None and now >= next_beat:
                next_beat = now + max(s.heartbeat_interval, 1.0)
                self._guarded(self._beat_node)
            if s.prune and now >= next_prune:
                # A batch per rule per pass, so a large backlog never holds up the relay and
                # the sweeps: the next pass goes on with it while more is left.
                more = self._guarded(prune.prune_some)
                next_prune = now if more else now + s.prune_interval
            if now >= next_sample:
                next_sample = now + SAMPLE_INTERVAL
                self._guarded(sample_queues_once)
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + s.sweep_interval
                self._guarded(sweep_stale_once)
                self._guarded(cancel_orphans_once)
                self._guarded(wake_missed_once)
            if time.monotonic() >= next_trim:
                next_trim = time.monotonic() + TRIM_INTERVAL
                self._guarded(trim_activity_once)

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

    def _guarded(self, job: Any) -> Any:
        try:
            return job(self.durable)
        except Exception:  # the database may be restarting; the next pass tries again
            log.exception("durable upkeep: %s failed", job.__name__)
            return None


def install(durable: Durable) -> None:
    """Run upkeep inside every worker of ``durable.app`` (a worker bootstep)."""
    if not durable.settings.upkeep:
        return

    class DurableUpkeep(bootsteps.StartStopStep):
        """Durable's relay, waker and stale-lock sweep, started and stopped with the worker."""

        requires = ("celery.worker.components:Pool",)

        def create(self, worker: Any) -> Upkeep:
            durable.engine.worker_pid = os.getpid()  # before the pool forks: drain() from a child
            return Upkeep(durable, worker)

        def start(self, worker: Any) -> None:
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

    durable.app.steps["worker"].add(DurableUpkeep)
