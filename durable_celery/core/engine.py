"""Step execution: claim a run, run one step, record its outcome and send the next message."""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from .. import signals
from ..definition import ParallelGroup, Step, Workflow
from ..errors import DurableError, RunStopped, StepTimeout, WorkerLost
from ..models import aware
from ..store import activity_rows, child_rows, event_rows, queries
from ..store.db import Clock
from . import continuation, flow, outcomes
from .atomic import AtomicSteps, StepTransaction
from .children import fan_out
from .context import RunContext, context_of, enter, leave
from .heartbeat import ActiveStep, Heartbeater, stop_reason
from .outcomes import ENDED, MessageResult, Outcome, error_record, with_logs
from .queues import queue_of
from .rollout import definition_changed, known_elsewhere
from .waits import Parked, Snoozed
from .writes import StepWrites

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("durable_celery")

_HOST = socket.gethostname()
# A first step's message whose run is not there yet: looked for again after these pauses (its
# start's INSERT on its way), then dropped; a run that exists never waits on them.
START_PAUSES = (0.005, 0.05)


def process_node(pid: int) -> str:
    """How a process of this host names itself in ``locked_by``: ``host:pid``."""
    return f"{_HOST}:{pid}"


class Engine(AtomicSteps, StepWrites):
    """Runs steps for one ``Durable``: the one place where step execution lives."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.db = rt.db
        self.heartbeater = Heartbeater(self)
        self.fenced_count = 0
        # When the grace period of a shutdown ends (0: not shutting down), in shared memory.
        self._drain_at = multiprocessing.RawValue("d", 0.0)
        # Whether the worker sends task events (set by its upkeep), for inline steps' events.
        self.task_events = multiprocessing.RawValue("b", 0)
        self.worker_pid = 0  # the Celery worker process this engine runs in, once it starts (upkeep.py)
        # Has a cold shutdown cut the grace period short? A worker's upkeep asks Celery's flag.
        self.cut_short: Callable[[], bool] = lambda: False

    @property
    def node(self) -> str:
        """This process as it appears in ``locked_by`` and on step rows: ``host:pid`` (each
        prefork pool process its own, so a dead one's runs are told apart)."""
        return process_node(os.getpid())

    # -- messages -------------------------------------------------------------------------

    def run_message(
        self,
        workflow: Workflow,
        step: Step,
        run_id: str,
        compensate: bool,
        queue: str | None,
        events: Any = None,
    ) -> MessageResult:
        """Handle one step message and run the steps it goes on to inline (continuation.py);
        returns what the message's own step came to. ``events`` (task_states.InlineEvents)
        announces each inline step as a task of its own."""
        settings = self.rt.settings
        node = f"{self.node}:{threading.get_ident()}"
        steps = 0 if self.rt.outbox.inline else settings.inline_steps
        try:
            with continuation.budget(node, queue, steps, settings.inline_seconds) as budget:
                first = result = self.execute_with_result(workflow, step, run_id, node, compensate)
                while result.continued is not None and budget is not None:
                    row = result.continued
                    budget.steps_left -= 1
                    following = workflow.steps[row.step_index]
                    shown = events.started(following, row) if events is not None else None
                    result = self.run_claimed(workflow, following, row)
                    self._free_slot(workflow, row, result)
                    if events is not None:
                        events.finished(shown, workflow, following, result)
                return first
        finally:
            if events is not None:
                events.close()

    def execute(self, workflow: Workflow, step: Step, run_id: str, compensate: bool) -> str:
        """Handle one step (or compensation) message; returns what happened ('completed',
        'dropped', 'fenced', ...)."""
        return self.execute_with_result(workflow, step, run_id, None, compensate).status

    def execute_with_result(
        self,
        workflow: Workflow,
        step: Step,
        run_id: str,
        node: str | None,
        compensate: bool,
    ) -> MessageResult:
        """``execute``, also giving the exception of an attempt that failed."""
        node = node or f"{self.node}:{threading.get_ident()}"
        if flow.limited(workflow):  # a throttle or concurrency limit decides the claim (flow.py)
            row = flow.claim(self.rt, workflow, step, run_id, node, compensate)
        else:
            with self.db.single() as conn:
                row = queries.claim_run(
                    self.db, conn, run_id, step.index, node, workflow.timeout, compensate=compensate
                )
            if row is None and step.index == 0 and not compensate and self.db.is_postgres:
                row = self._claim_after_start(workflow, run_id, node)
        if row is None:
            log.debug("durable: dropped message for run %s step %s", run_id, step.name)
            return MessageResult("dropped")
        result = self.run_claimed(workflow, step, row, compensate)
        if not compensate:
            self._free_slot(workflow, row, result)
        return result

    def _claim_after_start(self, workflow: Workflow, run_id: str, node: str) -> Any:
        """Claim the first step of a run whose message may have come before its start committed
        (a start sends it ahead: keys.start_run): wait for the start, then claim again. A run
        that does not exist yet is looked for again after each of ``START_PAUSES`` (its start's
        INSERT may not have reached the database); then its message is dropped."""
        for pause in (0.0, *START_PAUSES):
            time.sleep(pause)
            with self.db.single() as conn:
                queries.await_start(conn, run_id)
                row = queries.claim_run(self.db, conn, run_id, 0, node, workflow.timeout)
                if row is not None or queries.run_hold(conn, run_id) is not None:
                    return row  # claimed, or a run that exists and is not claimable
        return None

    def _free_slot(self, workflow: Workflow, row: Any, result: MessageResult) -> None:
        """The step's concurrency slot is free (unless its run went on inline): wake the run
        parked longest for it (``release`` looks only at a workflow with a concurrency limit)."""
        if result.continued is None:
            flow.release(self.rt, workflow, row.slot_key)

    def run_claimed(
        self, workflow: Workflow, step: Step, row: Any, compensate: bool = False
    ) -> MessageResult:
        """Run a step (or compensation) of a run this worker has claimed, and record it."""
        active = ActiveStep(self, row.id, row.fence, row.locked_by, step.timeout, compensate)
        ctx = context_of(row, step, active)
        started = self.db.utcnow()
        signals.step_started.send(
            sender=self.rt.sender,
            run_id=row.id,
            workflow=row.workflow,
            step=step.name,
            attempt=row.attempt,
        )
        if row.step_name is not None and row.step_name != step.name:
            if known_elsewhere(self.rt, row.workflow, row.step_name):  # a rolling deploy
                return MessageResult(self._code_elsewhere(row))
            changed = DurableError(definition_changed(row.workflow, row.step_name)["message"])
            return MessageResult(self._definition_changed(workflow, step, row, started), changed)
        if step.atomic:  # its writes commit with its record (atomic.py)
            status, outcome = self._run_atomic(workflow, step, row, ctx, compensate, started)
        else:
            outcome = self._observed_call(workflow, step, row, ctx, compensate)
            status = self._record_either(workflow, step, row, ctx, outcome, started, compensate)
        return MessageResult(status, outcome.error, row.attempt, continuation.take_claimed())

    def _observed_call(
        self, workflow: Workflow, step: Step, row: Any, ctx: RunContext, compensate: bool
    ) -> Outcome:
        """Run the step under the observability hook (instrument.py: its span, its logs)."""
        with self.rt.instrumentation.observe_step(workflow, ctx, row) as observed:
            outcome = self._call(step, ctx, compensate=compensate)
            observed.finish(outcome)
        outcome.logs = observed.logs
        return outcome

    def _record_either(
        self, workflow: Workflow, step: Step, row: Any, ctx: RunContext, outcome: Outcome,
        started: Any, compensate: bool, tx: StepTransaction | None = None,
    ) -> str:  # fmt: skip
        if compensate:
            return self._record_compensation(workflow, step, row, outcome, started, tx=tx)
        return self._record(workflow, step, row, ctx, outcome, started, tx=tx)

    def _call(self, step: Step, ctx: RunContext, compensate: bool) -> Outcome:
        active = ctx._active
        self.heartbeater.add(active)
        token = enter(ctx)
        outcome = Outcome()
        fn = step.compensate if compensate and step.compensate is not None else step.fn
        if isinstance(fn, ParallelGroup):  # a parallel step: its branches run as child runs
            fn = partial(fan_out, ctx, fn)
        try:
            outcome.value = fn(**ctx.input)
        except RunStopped as exc:
            outcome.stopped = active.stop_reason or exc.reason
        except Parked as parked:
            outcome.parked = parked
        except Snoozed as snoozed:
            outcome.snoozed = snoozed
        except Exception as exc:
            outcome.error = exc
        finally:
            active.finish()
            self.heartbeater.remove(active)
            leave(token)
        if outcome.stopped == "timeout":
            outcome.stopped = None
            outcome.error = StepTimeout(f"step {step.name!r} ran past its timeout of {step.timeout}s")
        if compensate and outcome.parked is not None:
            outcome.parked = None
            outcome.error = DurableError("a compensation cannot wait (sleep, events, input, children)")
        return outcome

    def beat(self, active: ActiveStep) -> str | None:
        """One heartbeat; returns None when fine, else 'cancelled' or 'fenced'."""
        with self.db.single() as conn:
            if queries.heartbeat_run(self.db, conn, active.run_id, active.fence, active.holder):
                return None
            now = queries.run_hold(conn, active.run_id)
        return stop_reason(now, active.fence, active.holder)

    def record_lost(
        self,
        workflow: Workflow,
        step: Step,
        run_id: str,
        pid: int,
        reason: str,
        compensate: bool = False,
        error: type[WorkerLost] | None = None,
    ) -> str:
        """A pool process died while running this step (seen by the worker that forked it): the
        attempt is used and recorded failed with ``WorkerLost`` (or ``error``: ``Terminated``
        for a control command's terminate); the run backs off, fails or compensates by the
        step's ``retry``, as if the step had raised. Returns what happened ('retrying',
        'failed', ...; 'dropped' when the process held no lock on the run)."""
        with self.db.engine.connect() as conn:
            row = queries.run_held_by(conn, run_id, f"{process_node(pid)}:")
        if row is None:
            return "dropped"  # it died before its claim, or after its record
        if row.step_index != step.index:
            if compensate or row.status != "running" or row.step_index >= len(workflow.steps):
                return "dropped"
            step = workflow.steps[row.step_index]  # a step it went on to inline (continuation.py)
        ctx = context_of(row, step, None)  # nothing runs: the process is gone
        lost = (error or WorkerLost)(f"the process running step {step.name!r} died: {reason}")
        outcome = Outcome(error=lost)
        log.warning("durable: run %s step %s lost its process (%s)", row.id, step.name, reason)
        # The claim's time is not kept; its last beat is (naive from SQLite: made aware).
        started = aware(row.heartbeat_at) or self.db.utcnow()
        worker = process_node(pid)
        if compensate:
            return self._record_compensation(workflow, step, row, outcome, started, worker)
        recorded = self._record(workflow, step, row, ctx, outcome, started, worker)
        flow.release(self.rt, workflow, row.slot_key)
        return recorded

    def hand_back_lost(self, run_id: str, pid: int, reason: str) -> str:
        """A pool process that held this run is gone, stopped by its worker (a cold shutdown):
        hand the run back, due now, without using an attempt (activity ``handed_back``)."""
        with self.db.engine.connect() as conn:
            row = queries.run_held_by(conn, run_id, f"{process_node(pid)}:")
        if row is None:
            return "dropped"
        with self.db.begin() as conn:
            done = queries.hand_back_txn(self.db, conn, row.id, row.fence, row.locked_by, 0)
            if done:
                details = {"step": row.step_name, "node": process_node(pid), "reason": reason}
                activity_rows.record_txn(self.db, conn, "handed_back", row.id, row.workflow, row.key, details)
        # Its concurrency slot stays its own: due now, it is counted before any parked run.
        log.warning("durable: run %s step %s handed back: %s", row.id, row.step_name, reason)
        return "handed_back" if done else "dropped"

    # -- results --------------------------------------------------------------------------

    def _record(
        self,
        workflow: Workflow,
        step: Step,
        row: Any,
        ctx: RunContext,
        outcome: Outcome,
        started: Any,
        worker: str | None = None,
        tx: StepTransaction | None = None,
    ) -> str:
        if outcome.stopped is not None:
            return self._stopped(workflow, step, row, outcome.stopped, outcome.logs)
        if outcome.parked is not None:  # its lines come again when the step runs from the top
            return self._park(workflow, step, row, outcome.parked)
        if outcome.snoozed is not None:
            return self._snooze(workflow, step, row, outcome.snoozed, outcome.logs)
        if outcome.error is None:
            outcome = outcomes.check_json(outcome, ctx.context)
        step_row = {
            "step_index": step.index,
            "name": step.name,
            "attempt": row.attempt,
            # No "input": it is the run's, kept once on the run (StepRecord.input reads it there).
            "worker": worker or self.node,
            "started_at": started,
            "finished_at": self.db.utcnow(),
            "logs": outcome.logs,  # log capture (logs.py)
        }
        if row.context:  # what the attempt found: a fork from this step starts with it
            step_row["context"] = row.context
        run_values, status = outcomes.after_step(self.rt.settings, workflow, step, row, ctx.context, outcome)
        if "step_index" in run_values:  # the run's queue is its next step's (queue stats, pausing)
            run_values["queue"] = queue_of(self.rt.default_queue(), workflow, run_values["step_index"])
        if outcome.error is None:
            step_row.update(status="completed", output=outcome.value)
        else:
            step_row.update(status="failed", error=error_record(outcome.error))
        go_on = continuation.go_on(self.shutting_down, status, run_values)  # claim the next step as well?
        recorded, fence_now = self._write(workflow, row, status, run_values, step_row, go_on, tx)
        if not recorded:
            return self._stopped(
                workflow, step, row, stop_reason(fence_now, row.fence, row.locked_by), node=worker
            )
        duration = (step_row["finished_at"] - started).total_seconds()
        finished = partial(
            signals.step_finished.send, sender=self.rt.sender, run_id=row.id, workflow=row.workflow,
            step=step.name, attempt=row.attempt, status=step_row["status"], duration=duration,
        )  # fmt: skip
        then = partial(self._after_write, workflow, row, status, run_values, sent=go_on is None)
        for fn in (finished, then):
            tx.on_commit(fn) if tx is not None else fn()
        return status

    def _after_write(
        self, workflow: Workflow, row: Any, status: str, run_values: dict[str, Any], sent: bool = True
    ) -> None:
        """Signal a finished run, or send the message for what the run does next (none when
        this worker took its next step itself, or left it for a paused queue's resume)."""
        if status in ENDED:
            signals.run_finished.send(
                sender=self.rt.sender, run_id=row.id, workflow=row.workflow, status=status
            )
        elif sent and status in ("running", "compensating") and run_values.get("published"):
            index = run_values["step_index"]
            compensate = status == "compensating"
            self.rt.outbox.send(workflow, index, row.id, 1, row.key, compensate=compensate)

    # -- compensations ---------------------------------------------------------------------

    def _record_compensation(
        self,
        workflow: Workflow,
        step: Step,
        row: Any,
        outcome: Outcome,
        started: Any,
        worker: str | None = None,
        tx: StepTransaction | None = None,
    ) -> str:
        """Record one compensation attempt; go on to the one before, retry, or end the run."""
        if outcome.stopped is not None:  # cancelled or fenced: a shutdown lets compensations end
            return self._stopped(workflow, step, row, outcome.stopped)
        if outcome.snoozed is not None:
            return self._snooze(workflow, step, row, outcome.snoozed, outcome.logs)
        step_row = {
            "step_index": step.index,
            "phase": "compensate",
            "name": step.name,
            "attempt": row.attempt,
            "worker": worker or self.node,
            "started_at": started,
            "finished_at": self.db.utcnow(),
            "logs": outcome.logs,
        }
        if outcome.error is None:
            step_row.update(status="completed", output=outcomes.json_or_none(outcome.value))
        else:
            step_row.update(status="failed", error=error_record(outcome.error))
        run_values = outcomes.after_compensation(self.rt.settings, workflow, step, row, outcome)
        if "step_index" in run_values:
            run_values["queue"] = queue_of(self.rt.default_queue(), workflow, run_values["step_index"])
        status = run_values.get("status", "compensating")
        recorded, fence_now = self._write(workflow, row, status, run_values, step_row, tx=tx)
        if not recorded:
            return self._stopped(
                workflow, step, row, stop_reason(fence_now, row.fence, row.locked_by), node=worker
            )
        then = partial(self._after_write, workflow, row, status, run_values)
        tx.on_commit(then) if tx is not None else then()
        return status

    def _park(self, workflow: Workflow, step: Step, row: Any, parked: Parked) -> str:
        with self.db.begin() as conn:
            done = event_rows.park_txn(
                self.db, conn, row.id, row.fence, row.locked_by, parked.name, parked.timeout
            )
            if done and parked.children:
                child_rows.due_if_any_finished_txn(self.db, conn, row.id, parked.children)
            fence_now = None if done else queries.run_hold(conn, row.id)
        if not done:
            return self._stopped(workflow, step, row, stop_reason(fence_now, row.fence, row.locked_by))
        return "waiting"

    def _definition_changed(self, workflow: Workflow, step: Step, row: Any, started: Any) -> str:
        """The run's current step is not this one any more (renamed or removed): fail the run,
        without compensation; ``retry`` resumes it once the step is back."""
        error = definition_changed(row.workflow, row.step_name)
        step_row = {
            "step_index": row.step_index,
            "name": row.step_name,
            "attempt": row.attempt,
            "status": "failed",
            "error": error,
            "worker": self.node,
            "started_at": started,
            "finished_at": self.db.utcnow(),
        }
        values = {"status": "failed", "error": error, "finished_at": Clock(), "due_at": None, "losses": 0}
        recorded, fence_now = self._write(workflow, row, "failed", values, step_row)
        if not recorded:
            return self._stopped(workflow, step, row, stop_reason(fence_now, row.fence, row.locked_by))
        self._after_write(workflow, row, "failed", values)
        return "definition_changed"

    def _code_elsewhere(self, row: Any) -> str:
        """The run's current step is not this build's but a live node has it: hand the run back
        for that node, without using an attempt (rollout.py)."""
        retry_in = self.rt.settings.missing_code_retry
        with self.db.begin() as conn:
            done = queries.hand_back_txn(self.db, conn, row.id, row.fence, row.locked_by, retry_in)
            if done:
                details = {"step": row.step_name, "retry_in": retry_in}
                activity_rows.record_txn(self.db, conn, "code_missing", row.id, row.workflow, None, details)
        log.warning("durable: no code for step %r here; run %s handed back", row.step_name, row.id)
        return "deferred" if done else "dropped"

    def _hand_back_for_shutdown(
        self, workflow: Workflow, step: Step, row: Any, logs: list[dict[str, Any]] | None
    ) -> str:
        """The grace period is over: give the run back, due now, for another worker."""
        with self.db.begin() as conn:
            done = queries.hand_back_txn(self.db, conn, row.id, row.fence, row.locked_by, 0)
            if done:
                details = with_logs({"step": step.name, "node": self.node}, logs)
                activity_rows.record_txn(self.db, conn, "handed_back", row.id, row.workflow, row.key, details)
            fence_now = None if done else queries.run_hold(conn, row.id)
        if not done:
            return self._stopped(workflow, step, row, stop_reason(fence_now, row.fence, row.locked_by))
        log.warning("durable: worker shutting down; run %s step %s handed back", row.id, step.name)
        return "handed_back"

    def drain(self, grace: float) -> None:
        """Start a graceful shutdown: steps see ``shutting_down()``; those still running after
        ``grace`` seconds are stopped and their runs handed back (compensations run on). The flag
        is in shared memory made before the pool forks: prefork children see it too."""
        if self._drain_at.value:
            return
        log.warning("durable: draining; running steps get %.0fs to finish", grace)
        self._drain_at.value = time.time() + grace
        self.heartbeater.poke()

    def hand_back_now(self) -> None:
        """End the grace period now (a cold shutdown): running steps are stopped, handed back."""
        self._drain_at.value = time.time()
        self.heartbeater.poke()

    def undrain(self) -> None:
        """A worker (re)starts in this process: steps are no longer shutting down."""
        self._drain_at.value = 0.0

    def shutting_down(self) -> bool:
        """Has this worker begun a graceful shutdown?"""
        return bool(self._drain_at.value)

    def drain_over(self) -> bool:
        """Is the grace period of a graceful shutdown over, or has a cold shutdown cut it short?"""
        return bool(self._drain_at.value) and (time.time() >= self._drain_at.value or self.cut_short())

    def _snooze(
        self, workflow: Workflow, step: Step, row: Any, snoozed: Snoozed, logs: list[dict[str, Any]] | None
    ) -> str:
        with self.db.begin() as conn:
            done = queries.hand_back_txn(self.db, conn, row.id, row.fence, row.locked_by, snoozed.seconds)
            if done:
                activity_rows.record_txn(
                    self.db,
                    conn,
                    "snoozed",
                    row.id,
                    row.workflow,
                    row.key,
                    with_logs(
                        {"step": step.name, "seconds": snoozed.seconds, "reason": snoozed.reason}, logs
                    ),
                )
            fence_now = None if done else queries.run_hold(conn, row.id)
        if not done:
            return self._stopped(workflow, step, row, stop_reason(fence_now, row.fence, row.locked_by))
        return "snoozed"

    def _stopped(
        self,
        workflow: Workflow,
        step: Step,
        row: Any,
        reason: str,
        logs: list[dict[str, Any]] | None = None,
        node: str | None = None,
    ) -> str:
        """What a step that may not record comes to; ``node``: whose result was dropped (a
        dead pool process's, when its worker records the loss: record_lost)."""
        if reason == "shutdown":
            return self._hand_back_for_shutdown(workflow, step, row, logs)
        if reason == "fenced":
            self.fenced_count += 1
            log.warning("durable: run %s step %s was taken over; result dropped", row.id, step.name)
            with self.db.begin() as conn:  # seen on the dashboard's Queues & nodes page
                details = {"step": step.name, "node": node or self.node, "attempt": row.attempt}
                kind = "worker_fenced"
                activity_rows.record_txn(self.db, conn, kind, row.id, row.workflow, row.key, details)
            signals.worker_fenced.send(
                sender=self.rt.sender, run_id=row.id, workflow=workflow.name, step=step.name
            )
        return reason
