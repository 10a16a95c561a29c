"""Periodic upkeep inside every worker: the outbox relay (relay.py), the sweeps (core/sweeps.py:
stale locks, workflow timeouts, missed wake-ups), pruning, queue samples, the node's heartbeat
row and its consumers of paused queues.

Any number of nodes can run it: the relay and the pruner take their rows with ``FOR UPDATE SKIP
LOCKED``, the sweeps end each run with an update that only matches while it is still stale or
overdue, and one node at a time writes a queue sample.

Three threads keep their own time, so no pass can starve another: the relay (which backs off
while the broker is down), the sweeper (timeouts, the node's heartbeat, stale locks) and
housekeeping (pruning, samples, the activity trim, closed batches). The sweeper treats a lock as stale only
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
from functools import partial
from typing import TYPE_CHECKING, Any

from celery import bootsteps
from celery import signals as celery_signals
from celery.exceptions import WorkerShutdown
from celery.worker import state as worker_state

from .. import signals
from ..capabilities import Capability
from ..core import prune, queues
from ..core.batches import drop_closed_once
from ..core.flow import SlotWaker
from ..core.sweeps import (
    SAMPLE_INTERVAL,
    cancel_orphans_once,
    fail_overdue_once,
    sample_queues_once,
    sweep_stale_once,
    trim_activity_once,
    wake_missed_once,
)
from ..errors import DatabaseUnavailable
from ..schedules import restore_schedules_once
from ..store import migrate, node_rows
from .app_argument import app_argument as _app_argument
from .lost import wait_recorded
from .nodes import Node
from .relay import BrokerDown, relay_once

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.runtime import Runtime

log = logging.getLogger("durable_celery")

__all__ = ["relay_once", "Upkeep", "install"]

TRIM_INTERVAL = 3600.0
RELAY_BACKOFF_MAX = 15.0  # the longest wait between relay passes while the broker is down
STOP_WAIT = 10.0  # the longest stop() waits for each thread's current pass (a query that hangs)


class Upkeep:
    """The upkeep threads of one worker (relay, sweeper, housekeeping), run until stopped."""

    def __init__(self, rt: Runtime, engine: Engine, app: Any, worker: Any = None) -> None:
        self.rt = rt
        self.engine = engine
        self.app = app
        self.node = Node(rt, app, worker) if worker is not None else None
        self.worker = worker
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._failing: set[str] = set()  # jobs failing now: logged once per outage
        self.slots = SlotWaker(rt)  # its passes go on from key to key
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
        s = self.rt.settings
        self._guarded(self._register_node)
        delay = s.poll_interval
        self._note_task_events()
        while not self._wait(delay):
            self._note_task_events()
            self._guarded(self._reconcile_queues)
            try:
                probe = delay != s.poll_interval  # the broker refused the last pass
                self._guarded(partial(relay_once, self.rt, self.app, probe=probe), raising=(BrokerDown,))
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
        self.engine.task_events.value = int(on)

    def _sweep_loop(self) -> None:
        s = self.rt.settings
        next_sweep = time.monotonic() + min(s.sweep_interval, s.stale_lock_timeout)
        next_beat = time.monotonic()
        while not self._wait(s.poll_interval):
            rt = self.rt
            self._observe(self._guarded(partial(fail_overdue_once, rt)) is not None)  # a list, even if empty
            now = time.monotonic()
            if self.node is not None and now >= next_beat:
                next_beat = now + max(s.heartbeat_interval, 1.0)
                self._guarded(self._beat_node)
            if now >= next_sweep:
                next_sweep = now + s.sweep_interval
                if self.may_sweep_stale():
                    self._guarded(partial(sweep_stale_once, rt))
                self._guarded(partial(cancel_orphans_once, rt))
                self._guarded(partial(wake_missed_once, rt))
                self._guarded(self.slots.wake_slots_once)
                self._guarded(partial(restore_schedules_once, rt, self.app))

    def _housekeeping_loop(self) -> None:
        rt, s = self.rt, self.rt.settings
        next_trim = next_prune = next_sample = time.monotonic()
        while not self._wait(s.poll_interval):
            now = time.monotonic()
            if s.prune and now >= next_prune:
                # A batch per rule per pass, so a large backlog never holds up the others: the
                # next pass goes on with it while more is left.
                more = self._guarded(partial(prune.prune_some, rt.db, s.prune))
                next_prune = now if more else now + s.prune_interval
            if now >= next_sample:
                next_sample = now + SAMPLE_INTERVAL
                self._guarded(partial(sample_queues_once, rt))
            if now >= next_trim:
                next_trim = now + TRIM_INTERVAL
                self._guarded(partial(trim_activity_once, rt.db))
                self._guarded(partial(drop_closed_once, rt.db))

    def _observe(self, reached: bool) -> None:
        """Note whether the sweeper's last pass reached the database."""
        if not reached:
            self.db_seen_since = None
        elif self.db_seen_since is None:
            self.db_seen_since = time.monotonic()
            log.warning(
                "durable: the database is back; stale locks are swept once it has been seen for %.0fs",
                self.rt.settings.stale_lock_timeout,
            )

    def may_sweep_stale(self) -> bool:
        """Has this node seen the database for ``stale_lock_timeout`` without a break? Only then
        can it tell a silent worker from one that could not reach the database either."""
        since = self.db_seen_since
        return since is not None and time.monotonic() - since >= self.rt.settings.stale_lock_timeout

    def _register_node(self) -> None:
        if self.node is not None:
            self.node.register()

    def mark_draining(self) -> None:
        """Show this node as draining (``durable nodes``, ``status``) while it shuts down."""
        if self.node is not None:
            with self.rt.db.begin() as conn:
                node_rows.mark_draining(conn, self.node.name)

    def _beat_node(self) -> None:
        if self.node is not None:
            self.node.beat()

    def _reconcile_queues(self) -> None:
        if self.node is not None:
            self.node.reconcile(queues.paused_queues(self.rt.db))

    def _guarded(self, job: Any, raising: tuple[type[BaseException], ...] = ()) -> Any:
        """Run one job; an error (the database may be restarting) is logged once until the job
        works again, and the next pass tries again. Returns None when it failed."""
        name = getattr(getattr(job, "func", job), "__name__", str(job))
        try:
            result = job()
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


def announce_draining(rt: Runtime, worker: Any, grace: float) -> None:
    """Send ``signals.worker_draining``: this worker begins its graceful shutdown."""
    try:
        signals.worker_draining.send(sender=rt.sender, node=getattr(worker, "hostname", None), grace=grace)
    except Exception:  # a receiver's error must not stop the shutdown
        log.exception("durable: a worker_draining receiver failed")


def refuse_to_start(message: str) -> None:
    """Stop a starting worker (exit code 1), saying why once: in the worker's log, and on the
    terminal only when the log does not already go there (a --logfile)."""
    log.critical(message)
    if not _logged_to_terminal(log):
        print(message, file=sys.__stderr__, flush=True)
    raise WorkerShutdown(1)


def _logged_to_terminal(logger: logging.Logger) -> bool:
    """Does a CRITICAL record of ``logger`` reach a handler writing to standard error?"""
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if getattr(handler, "stream", None) in (sys.stderr, sys.__stderr__):
                return True
        current = current.parent if current.propagate else None
    return False


def refuse_old_schema(rt: Runtime) -> None:
    """Stop a starting worker whose database is behind this code's schema (exit code 1), with
    one line naming the pending revisions and the command that applies them."""
    if rt.db.bad_url is not None:  # no database at all can be reached with this URL
        refuse_to_start(f"durable: {rt.db.bad_url}")
    try:
        pending = migrate.pending_revisions(rt.db)
    except DatabaseUnavailable as exc:
        if exc.misconfigured:  # no such database or user: a configuration error, not an outage
            refuse_to_start(f"durable: database unavailable at {exc.url} ({exc.reason}); fix: {exc.fix}")
        log.error("durable: could not check the database schema at start (%s)", exc.reason)
        return
    except Exception as exc:  # the database is away: the worker starts and waits for it
        log.error("durable: could not check the database schema at start (%s)", str(exc).splitlines()[0])
        return
    if pending:
        fix = rt.db.migrate_fix or f"run `celery -A {_app_argument()} durable migrate`"
        message = (
            f"durable: the database schema is behind this code (pending revisions: {', '.join(pending)}); "
            f"{fix}, then start this worker again"
        )
        refuse_to_start(message)


def refuse_forking_pool(rt: Runtime, worker: Any) -> None:
    """Stop a starting worker whose pool forks processes when the store is one process only
    (the in-memory store): each pool process would see a copy of its own."""
    from celery.concurrency.prefork import TaskPool as ForkingPool

    if Capability.MULTI_PROCESS in rt.capabilities:
        return
    if not isinstance(getattr(worker, "pool", None), ForkingPool):
        return
    message = (
        f"durable: the {rt.db.masked_url} store is one process only (missing MULTI_PROCESS): "
        "start this worker with --pool threads (or solo), or give Durable a database URL"
    )
    refuse_to_start(message)


def _cold_shutdown_asked() -> bool:
    """Has Celery been asked for a cold shutdown in this process?"""
    return bool(worker_state.should_terminate)


def install(rt: Runtime, engine: Engine, app: Any) -> None:
    """Run upkeep inside every worker of ``app`` (a worker bootstep)."""

    class DurableUpkeep(bootsteps.StartStopStep):
        """Durable's schema check, relay, waker and stale-lock sweep, started and stopped with
        the worker."""

        requires = ("celery.worker.components:Pool",)

        def create(self, worker: Any) -> Upkeep | None:
            engine.worker_pid = os.getpid()  # before the pool forks: drain() from a child
            # A second Ctrl-C (or SIGQUIT) during the grace period: Celery's flag, set by its
            # signal handler wherever the main thread was, ends the grace period at the next
            # heartbeat tick, even when the handler's own cancel never reaches the pool's wait.
            engine.cut_short = _cold_shutdown_asked
            celery_signals.worker_shutdown.connect(self.on_worker_shutdown, sender=worker)
            # Task events on from the start (-E): inline steps send theirs from the first one.
            sends = getattr(worker, "task_events", None) or worker.app.conf.worker_send_task_events
            engine.task_events.value = int(bool(sends))
            return Upkeep(rt, engine, app, worker) if rt.settings.upkeep else None

        def start(self, worker: Any) -> None:
            refuse_forking_pool(rt, worker)
            refuse_old_schema(rt)
            engine.undrain()
            super().start(worker)

        def stop(self, worker: Any) -> None:
            # Steps stop in reverse order: the consumer has stopped taking work, the pool
            # (stopped after this) waits for running steps; those still running after the
            # grace period are handed back. A cold shutdown that ends up here (the threads
            # pool cannot cancel its steps, so Celery stops it warm) hands them back at once.
            grace = 0.0 if worker_state.should_terminate else rt.settings.shutdown_grace_period
            engine.drain(grace)
            announce_draining(rt, worker, grace)
            upkeep = getattr(self, "obj", None)
            if upkeep is not None:
                upkeep._guarded(upkeep.mark_draining)
            super().stop(worker)

        def terminate(self, worker: Any) -> None:
            # A cold shutdown: no grace period, but the node is leaving all the same, so other
            # nodes stop counting on its code at once (rollout.py) and its queues' consumers.
            # The steps it cancelled are being handed back (lost.py): let those writes land.
            wait_recorded(STOP_WAIT)
            upkeep = getattr(self, "obj", None)
            if upkeep is not None:
                upkeep._guarded(upkeep.mark_draining)
            super().terminate(worker)

        def on_worker_shutdown(self, sender: Any = None, **_: Any) -> None:
            """A cold shutdown that cut a warm one short: the threads pool cannot cancel its
            steps, so Celery leaves them running as the process ends; hand them back first."""
            if not worker_state.should_terminate:
                return
            engine.hand_back_now()
            deadline = time.monotonic() + STOP_WAIT
            while time.monotonic() < deadline and any(
                getattr(request.task, "durable_engine", None) is engine
                for request in list(worker_state.active_requests)
            ):
                time.sleep(0.02)

    app.steps["worker"].add(DurableUpkeep)
