"""Run control: cancel, retry, rerun, release a key, send an event; and what a committed
key decision sets off (``after_commit``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

from .. import signals
from ..errors import InvalidArgument, KeyContended, KeyTaken, NoKey, NotFinished, RunNotFound
from ..inputs import check_input
from ..store import activity_rows, child_rows, control_rows, event_rows, key_rows, queries
from ..store.schema import FINISHED, UNFINISHED
from . import atomic
from .flow import settle_parked_start
from .keys import MAX_HANDS, Decision, end_run_txn, reuse_frees, start_run
from .runs import new_run
from .waits import INPUT, check_event

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from ..definition import Workflow
    from .runtime import Runtime

CANCELLABLE = ("pending", "running", "waiting")  # a compensating run finishes what it started


def _run(conn: Connection, run_id: Any, lock: bool = False) -> Any:
    row = queries.fetch_run(conn, run_id, lock) if isinstance(run_id, str) else None
    if row is None:
        raise RunNotFound(run_id)
    return row


def after_commit(rt: Runtime, decision: Decision) -> None:
    """Once a decision's transaction committed: publish, send signals, cancel replaced runs'
    children, then raise the refusal if there was one."""
    for workflow, run_id, step_index, attempt, key in decision.publish:
        rt.outbox.send_named(workflow, run_id, step_index, attempt, key, soon=True)
    for signal, kwargs in decision.notices:
        signal.send(sender=rt.sender, **kwargs)
    for run_id in decision.cancel_children:
        cancel_children(rt, run_id)
    for workflow, slot_key in decision.parked:
        settle_parked_start(rt, workflow, slot_key)
    if decision.error is not None:
        raise decision.error


def cancel(rt: Runtime, run_id: str, by: str | None = None, origin: str | None = None) -> bool:
    """Cancel an unfinished run and its unfinished children; False if it had finished (or is
    compensating). A ``cancelled`` activity entry says who (``by``) and from where (``origin``)."""
    db = rt.db
    with db.begin() as conn:
        run = _run(conn, run_id)
        if run.status not in CANCELLABLE:
            return False
        if run.key and run.runs_after_id:
            key_rows.forget_waiting_txn(conn, run_id)  # a run_again run stops waiting
        error = {"type": "Cancelled", "message": "cancelled", "traceback": None}
        done, settled = end_run_txn(
            rt,
            conn,
            run,
            "cancelled",
            lambda c: queries.cancel_run_txn(db, c, run_id, error, CANCELLABLE),
        )
        if not done:
            return False
        activity_rows.record_txn(
            db, conn, "cancelled", run_id, run.workflow, run.key, {"by": by, "from": origin}
        )
        children = child_rows.unfinished_children(conn, run_id)
    signals.run_finished.send(sender=rt.sender, run_id=run_id, workflow=run.workflow, status="cancelled")
    if settled is not None:
        after_commit(rt, settled)
    for child_id in children:  # each in a transaction of its own: key rows before run rows
        cancel(rt, child_id, f"cancel of parent {run_id}", origin)
    return True


def cancel_children(rt: Runtime, run_id: str) -> int:
    """Cancel the unfinished children of a run that was cancelled; returns how many."""
    with rt.db.engine.connect() as conn:
        children = child_rows.unfinished_children(conn, run_id)
    return sum(cancel(rt, child_id, f"cancel of parent {run_id}") for child_id in children)


def retry(rt: Runtime, run_id: str, by: str | None = None, origin: str | None = None) -> str:
    """Resume a failed run from its failed step, taking its key back if it lost it; a
    ``retried`` activity entry says who (``by``) and from where (``origin``)."""
    db = rt.db
    with db.begin() as conn:
        run = _run(conn, run_id)
        if run.status in UNFINISHED:
            raise NotFinished(f"run {run_id} is {run.status}")
        if run.status != "failed":
            raise InvalidArgument(f"only failed runs can be retried; run {run_id} is {run.status}")
        workflow = rt.registry.resolve(run.workflow)
        retaken, previous = _retake_key_txn(rt, conn, workflow, run) if run.key is not None else (False, None)
        resumed = control_rows.resume_failed_txn(db, conn, run_id, run.started_at is not None, run.attempt)
        if not resumed:  # pruned or retried meanwhile: roll back the key taken above
            _run(conn, run_id)  # RunNotFound when it was pruned
            raise NotFinished(f"run {run_id} was retried meanwhile")
        details = {"by": by, "from": origin, "step": run.step_name, "attempt": run.attempt + 1}
        activity_rows.record_txn(db, conn, "retried", run_id, run.workflow, run.key, details)
    rt.outbox.send_named(run.workflow, run_id, run.step_index, run.attempt + 1, run.key, soon=True)
    if retaken:
        signals.key_handoff.send(
            sender=rt.sender, run_id=run_id, workflow=run.workflow, key=run.key, previous_id=previous
        )
    return run_id


def _retake_key_txn(rt: Runtime, conn: Connection, workflow: Workflow, run: Any) -> tuple[bool, str | None]:
    """Take the key back for a retried run: (whether it was retaken, from which run)."""
    db, name = rt.db, workflow.name or ""
    for _ in range(MAX_HANDS):
        holder = key_rows.lock_key_txn(db, conn, name, run.key)
        if holder is None:
            if not key_rows.claim_key_txn(db, conn, name, run.key, run.id):
                continue
        elif holder.holder_id == run.id:
            return False, None
        elif reuse_frees(workflow.reuse, holder.status):
            key_rows.hand_key_txn(db, conn, name, run.key, run.id)
        else:
            raise KeyTaken(holder.holder_id)
        previous = holder.holder_id if holder is not None else None
        activity_rows.record_txn(db, conn, "key_retaken", run.id, name, run.key, {"from": previous})
        return True, previous
    raise KeyContended(f"key {run.key!r} of {name!r} changed hands {MAX_HANDS} times")


def rerun(rt: Runtime, run_id: str) -> str:
    """Start a fresh copy of a finished run (same input and key); KeyTaken if the key is held.

    Held means by any holder: a debounced run waiting out its period is refused like the rest,
    never handed the old run's input (a rerun is not one more save in a burst)."""
    with rt.db.engine.connect() as conn:
        run = _run(conn, run_id)
    if run.status not in FINISHED:
        raise NotFinished(f"run {run_id} is {run.status}")
    workflow = rt.registry.resolve(run.workflow)
    data = check_input(run.input, rt.settings.max_input_bytes)  # as start checks it
    key = workflow.derive_key(data, run.key)
    fresh = new_run(
        rt.default_queue(), workflow, data, key, run.tags, run.priority, rt.settings.priority_aging
    )
    rt.instrumentation.stamp_run(workflow, fresh)
    decision = start_run(rt, workflow, fresh, "error", fold=False)
    after_commit(rt, decision)
    return decision.run_id


def release_key(rt: Runtime, run_id: str, by: str | None) -> None:
    """Free a finished run's key; the run keeps its history and its ``key``."""
    db = rt.db
    with db.begin() as conn:
        run = _run(conn, run_id)
        if run.status not in FINISHED:
            raise NotFinished(f"run {run_id} is {run.status}: cancel it first")
        if run.key is None or not key_rows.release_key_txn(conn, run_id):
            raise NoKey(f"run {run_id} holds no key")
        activity_rows.record_txn(db, conn, "key_released", run_id, run.workflow, run.key, {"by": by})
    signals.key_release.send(sender=rt.sender, run_id=run_id, workflow=run.workflow, key=run.key, by=by)


def send_event(rt: Runtime, run_id: str, name: str, payload: Any, buffer: bool) -> bool:
    """Deliver an event; True if a waiting run got it or it was kept (``buffer=True``)."""
    check_event(name, payload)
    return _deliver(rt, run_id, name, payload, buffer)


def provide_input(rt: Runtime, run_id: str, name: str, value: Any) -> bool:
    """Give a run the input ``name`` it waits (or will wait) for; False if it has finished."""
    check_event(name, value)
    return _deliver(rt, run_id, INPUT + name, value, True)


def _deliver(rt: Runtime, run_id: str, name: str, payload: Any, buffer: bool) -> bool:
    db = rt.db
    joined = atomic.current()  # inside an atomic step: the event commits with it
    joined = joined if joined is not None and joined.db is db else None
    with _transaction(db, joined) as conn:
        # Locked: a step parking on this event at the same moment either parks first (and is
        # woken here) or waits for this commit and then finds the event (event_rows.park_txn).
        run = _run(conn, run_id, lock=True)
        if run.status in FINISHED:
            return False
        if buffer:
            event_rows.insert_event_txn(db, conn, run_id, name, payload)
            woken = event_rows.wake_if_waiting_txn(db, conn, run_id, name)
        else:
            woken = event_rows.wake_if_waiting_txn(db, conn, run_id, name)
            if woken is None:
                return False
            event_rows.insert_event_txn(db, conn, run_id, name, payload)
    if woken is not None:
        decision = Decision(run_id, publish=[tuple(woken)])  # type: ignore[list-item]
        then = partial(after_commit, rt, decision)
        joined.on_commit(then) if joined is not None else then()
    return True


@contextmanager
def _transaction(db: Any, joined: Any) -> Iterator[Any]:
    """The joined atomic step's connection, or a transaction of its own."""
    if joined is not None:
        yield joined.conn
        return
    with db.begin() as conn:
        yield conn
