"""Atomic steps (``@wf.step(atomic=True)``): a step whose writes commit with durable's record of
it, in one transaction, so they happen once however often the step is tried.

The engine opens the transaction (``Database.step_transaction``; a ``DjangoDurable``'s is
``transaction.atomic`` on its alias, so the ORM writes in it) and runs the step with
``current_run().connection`` on it. Before the commit it makes the fence-checked update of the
run and writes the step's record on the same connection: if the fence moved (the run was
cancelled, or taken over after a stale lock), the whole transaction rolls back, the step's own
writes included. Whatever else the step comes to (it raised, timed out, was stopped, waits or
snoozes) rolls its writes back first and is then recorded as for any step, in a transaction of
its own; a step that waits runs again from the top when the wait is over, as every step does.
Starts and ``send_event`` made inside the step join the transaction: what they set off (their
messages, signals) waits for the commit, as does the step's own next message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from ..definition import Step, Workflow
    from .outcomes import Outcome

log = logging.getLogger("durable_celery")

_open: ContextVar[StepTransaction | None] = ContextVar("durable_step_transaction", default=None)


class StepTransaction:
    """An atomic step's open transaction: the connection its writes and durable's record share,
    the ORM sessions made on it, and what waits for its commit. A start joins it as it joins a
    caller's transaction (``transactions.JoinedTransaction``)."""

    def __init__(self, db: Any, conn: Connection) -> None:
        self.db = db
        self.conn = conn
        self.recorded = False  # durable's record of the step was written on it
        self._after: list[Callable[[], None]] = []
        self._sessions: list[Session] = []

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """The transaction's connection (for a start that joins it)."""
        yield self.conn

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the step's transaction has committed (never if it rolls back)."""
        self._after.append(fn)

    def session(self) -> Session:
        """An ORM Session bound to the transaction's connection; durable flushes it before its
        record and commits the whole (``session.commit()`` commits nothing of the transaction)."""
        made = Session(bind=self.conn, join_transaction_mode="create_savepoint")
        self._sessions.append(made)
        return made

    def flush(self) -> None:
        """Write what the step's sessions still hold, before durable's record of the step, and
        release their savepoints (closing a session later rolls back to its savepoint)."""
        for session in self._sessions:
            session.commit()

    def close(self) -> None:
        """Close the step's sessions (their objects stay readable, detached)."""
        for session in self._sessions:
            session.close()

    def committed(self) -> None:
        """Run what waited for the commit; an error in one is logged, the others still run."""
        for fn in self._after:
            try:
                fn()
            except Exception:  # a message not sent is the relay's to send
                log.exception("durable: after an atomic step's commit")


def check_target(db: Any, step: Step) -> None:
    """InvalidDefinition when an atomic step names where it writes and that is not durable's
    database: its writes there could not commit with durable's record of it."""
    where = step.atomic
    if isinstance(where, bool) or db.same_database(where):
        return
    from ..errors import InvalidDefinition

    shown = getattr(where, "url", None) or where
    if not isinstance(shown, str):
        shown = shown.render_as_string(hide_password=True)
    raise InvalidDefinition(
        f"step {step.name!r} of workflow {step.workflow_name!r} is atomic on {shown}, but an atomic step "
        f"commits with durable's record on durable's database ({db.masked_url}); its writes on another "
        "database would happen once per attempt: write on durable's database, or drop atomic= and make "
        "the writes idempotent"
    )


def current() -> StepTransaction | None:
    """The transaction of the atomic step running in this thread, if any."""
    return _open.get()


class _Undo(Exception):
    """Roll the step's transaction back: the step did not complete, or its record was refused."""


class AtomicSteps:
    """The engine's part for atomic steps (mixed into ``engine.Engine``)."""

    def _run_atomic(
        self,
        workflow: Workflow,
        step: Step,
        row: Any,
        ctx: Any,  # context.RunContext (not imported: the context's waits use this module)
        compensate: bool,
        started: Any,
    ) -> tuple[str, Outcome]:
        """Run the step in its transaction and record it there; anything but a completed step
        is rolled back and recorded as usual. Returns what the step came to, and its outcome."""
        engine: Any = self
        outcome: Outcome | None = None
        tx: StepTransaction | None = None
        try:
            with engine.db.step_transaction(step.timeout, engine.rt.settings.stale_lock_timeout) as conn:
                tx = StepTransaction(engine.db, conn)
                token, ctx._transaction = _open.set(tx), tx
                try:
                    outcome = engine._observed_call(workflow, step, row, ctx, compensate)
                    _flush(tx, outcome)
                    if not _completed(outcome):
                        raise _Undo
                    status = engine._record_either(workflow, step, row, ctx, outcome, started, compensate, tx)
                    if not tx.recorded:  # fenced or cancelled: nothing of the step may stay
                        raise _Undo
                finally:
                    _open.reset(token)
                    ctx._transaction = None
                    tx.close()
        except _Undo:
            assert outcome is not None
            if tx is not None and tx.recorded is False and _completed(outcome):
                return status, outcome  # the record was refused: _stopped has said why
            return engine._record_either(workflow, step, row, ctx, outcome, started, compensate), outcome
        tx.committed()
        return status, outcome


def _completed(outcome: Outcome) -> bool:
    return (
        outcome.error is None
        and outcome.stopped is None
        and outcome.parked is None
        and outcome.snoozed is None
    )


def _flush(tx: StepTransaction, outcome: Outcome) -> None:
    """Flush the step's ORM sessions; a write they refuse (a constraint) fails the step."""
    if not _completed(outcome):
        return
    try:
        tx.flush()
    except Exception as exc:
        outcome.error = exc
