"""Liveness of running steps: one heartbeat thread per process refreshes their locks, enforces
step timeouts and a shutdown's grace period, and stops a step (inside its own thread) when its
run was cancelled, taken over, timed out or handed back."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import RunStopped

if TYPE_CHECKING:
    from ..store.db import Database
    from .runtime import Runtime

log = logging.getLogger("durable_celery")


class StepCancelled(RunStopped):
    """The run was cancelled (or otherwise ended, e.g. by its timeout) while this step ran."""

    def __init__(self, reason: str = "cancelled") -> None:
        super().__init__(reason)


class StepFenced(RunStopped):
    """Another worker took the run over; this one may not record anything."""

    def __init__(self, reason: str = "fenced") -> None:
        super().__init__(reason)


class StepShutdown(RunStopped):
    """The worker is shutting down and the grace period is over: the run is handed back."""

    def __init__(self, reason: str = "shutdown") -> None:
        super().__init__(reason)


class StepTimedOut(RunStopped):
    """The step ran past its timeout."""

    def __init__(self, reason: str = "timeout") -> None:
        super().__init__(reason)


STOPS: dict[str, type[RunStopped]] = {
    "cancelled": StepCancelled,
    "fenced": StepFenced,
    "timeout": StepTimedOut,
    "shutdown": StepShutdown,
}


def stop_reason(now: Any, fence: int, holder: str | None) -> str:
    """Why a step may not go on, from the run's fence and ``locked_by`` ``now`` (None: no such
    run): another worker took the run over (its fence moved on, or another holds it under the
    same fence after a server crash lost this claim), or the run ended under it (cancelled,
    timed out, deleted)."""
    if now is None:
        return "cancelled"
    taken = now.fence != fence or (now.locked_by is not None and now.locked_by != holder)
    return "fenced" if taken else "cancelled"


class StepHost(Protocol):
    """What a running step needs of the engine that runs it (``engine.Engine``)."""

    rt: Runtime
    db: Database

    def beat(self, active: ActiveStep) -> str | None:
        """One heartbeat; None when fine, else why the step must stop."""
        ...

    def shutting_down(self) -> bool:
        """Has this worker begun a graceful shutdown?"""
        ...

    def drain_over(self) -> bool:
        """Is the grace period of a graceful shutdown over?"""
        ...


class ActiveStep:
    """A step running on this process: its lock token, deadline and how to stop it."""

    def __init__(
        self,
        engine: StepHost,
        run_id: str,
        fence: int,
        holder: str,
        timeout: float | None,
        compensate: bool = False,
    ) -> None:
        self.engine = engine
        self.compensate = compensate  # compensations are never stopped for a shutdown
        self.run_id = run_id
        self.fence = fence
        self.holder = holder  # the claim's locked_by, checked with the fence by every write
        self.thread_id = threading.get_ident()
        self.deadline = time.monotonic() + timeout if timeout else None
        self.next_beat = time.monotonic() + engine.rt.settings.heartbeat_interval
        self.stop_reason: str | None = None
        self._running = True
        self._lock = threading.Lock()

    def heartbeat_now(self) -> None:
        """Heartbeat from the step's own thread; raises RunStopped when the run is gone."""
        reason = self.engine.beat(self)
        if reason is not None:
            self.stop_reason = reason
            raise STOPS[reason]()

    def interrupt(self, reason: str) -> None:
        """Raise the matching RunStopped inside the step's thread, if it is still running."""
        with self._lock:
            if not self._running or self.stop_reason is not None:
                return
            self.stop_reason = reason
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.thread_id), ctypes.py_object(STOPS[reason])
            )

    def finish(self) -> None:
        """Stop accepting interrupts and drop one that was sent but not yet raised."""
        while True:
            try:
                with self._lock:
                    self._running = False
                    if self.stop_reason is not None:
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)
                return
            except RunStopped:  # raised between the step's end and the lock: it came too late
                continue


# Seconds without a step to watch before the thread ends; the next step starts a new one.
IDLE_EXIT = 5.0


class Heartbeater:
    """One thread per process that heartbeats running steps and enforces their timeouts."""

    def __init__(self, engine: StepHost) -> None:
        self.engine = engine
        self.active: set[ActiveStep] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._failing = False

    def add(self, step: ActiveStep) -> None:
        """Watch a step until :meth:`remove`."""
        with self._lock:
            self.active.add(step)
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, name="durable-heartbeat", daemon=True)
                self._thread.start()

    def remove(self, step: ActiveStep) -> None:
        """Stop watching a step."""
        with self._lock:
            self.active.discard(step)

    def _loop(self) -> None:
        interval = self.engine.rt.settings.heartbeat_interval
        tick = min(0.25, interval / 4)
        idle_since: float | None = None
        while True:
            self._wake.wait(tick)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                watched = list(self.active)
                if watched:
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since >= IDLE_EXIT and self._thread is threading.current_thread():
                    self._thread = None  # add() starts another; no thread ticks for an idle process
                    return
            for step in watched:
                try:
                    beat = self._check(step, now, interval)
                except Exception:  # a database outage must not kill the heartbeat thread
                    self._failed(step)
                else:
                    if beat:
                        self._worked()

    def _failed(self, step: ActiveStep) -> None:
        # Logged once per outage, not once per step and beat; the step runs on, and its next
        # beat after the outage keeps its lock (upkeep sweeps nothing until then).
        if not self._failing:
            self._failing = True
            log.exception("durable: heartbeat of run %s failed; retrying while the step runs", step.run_id)

    def _worked(self) -> None:
        if self._failing:
            self._failing = False
            log.warning("durable: heartbeats get through again")

    def poke(self) -> None:
        """Run a pass now (e.g. a shutdown began)."""
        self._wake.set()

    def _check(self, step: ActiveStep, now: float, interval: float) -> bool:
        """Stop the step if it must stop, else heartbeat it when due; True if it beat."""
        if step.deadline is not None and now >= step.deadline:
            step.interrupt("timeout")
        elif not step.compensate and self.engine.drain_over():
            step.interrupt("shutdown")
        elif now >= step.next_beat:
            step.next_beat = now + interval
            reason = self.engine.beat(step)
            if reason is not None:
                step.interrupt(reason)
            return True
        return False
