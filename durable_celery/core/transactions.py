"""Starting a run inside the caller's own transaction: a SQLAlchemy Connection or Session, or
any transaction that offers a SQLAlchemy connection inside it and a way to run a function once it
commits (``JoinedTransaction``: Django's, in ``contrib.django``).

A duplicate never raises a database error here (the key row is taken with ON CONFLICT DO
NOTHING), so the caller's transaction stays usable; a rollback removes the run and its key.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sqlalchemy import Connection, event
from sqlalchemy.orm import Session

from ..errors import InvalidArgument
from ..store import queries
from .control import after_commit
from .keys import decide_start_txn

if TYPE_CHECKING:
    from ..definition import SendEvent, Workflow
    from .runtime import Runtime


@runtime_checkable
class JoinedTransaction(Protocol):
    """A caller's open transaction that a start may join (``start(..., connection=...)``)."""

    def connect(self) -> AbstractContextManager[Connection]:
        """A SQLAlchemy connection whose statements run inside the caller's transaction."""
        ...

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the caller's transaction commits (never if it rolls back)."""
        ...


def callers_connection(connection: Any) -> tuple[Connection, Session | None]:
    """The Connection to write on, and the Session it came from (if it came from one)."""
    if isinstance(connection, Session):
        return connection.connection(), connection
    if isinstance(connection, Connection):
        if not connection.in_transaction():
            raise InvalidArgument("connection= must be inside an open transaction (conn.begin())")
        return connection, None
    raise InvalidArgument(
        f"connection= takes a SQLAlchemy Connection or Session (or django_connection()), not "
        f"{type(connection).__name__}"
    )


def start_in_callers_transaction(
    rt: Runtime,
    connection: Any,
    workflow: Workflow,
    run: dict[str, Any],
    policy: str | SendEvent,
) -> str:
    """Decide the start on the caller's connection; messages go out only after their commit.

    A Session publishes from its ``after_commit`` hook. A bare Connection has no such hook, so
    the runs to send are flagged unsent and the relay sends them once the commit is visible.
    """
    if isinstance(connection, JoinedTransaction):
        return _start_joined(rt, connection, workflow, run, policy)
    conn, session = callers_connection(connection)
    if not _same_database(conn, rt):
        raise InvalidArgument("connection= must be on the database Durable uses")
    decision = _decide(rt, conn, workflow, run, policy)
    error, decision.error = decision.error, None
    if session is not None:
        _after_outcome(session, lambda: after_commit(rt, decision))
    else:
        if decision.publish:
            queries.mark_unsent(conn, [dispatch[1] for dispatch in decision.publish])
            decision.publish = []
        decision.cancel_children = []  # the upkeep's orphan sweep does it once this commits
        after_commit(rt, decision)
    if error is not None:
        raise error
    return decision.run_id


def _start_joined(
    rt: Runtime, joined: JoinedTransaction, workflow: Workflow, run: dict[str, Any], policy: str | SendEvent
) -> str:
    """Decide the start inside ``joined``; what it sets off (the first message, signals, a
    replaced run's children) waits for the commit."""
    with joined.connect() as conn:
        if not _same_database(conn, rt):
            raise InvalidArgument("connection= must be on the database Durable uses")
        decision = _decide(rt, conn, workflow, run, policy)
    error, decision.error = decision.error, None
    joined.on_commit(lambda: after_commit(rt, decision))
    if error is not None:
        raise error
    return decision.run_id


def _decide(
    rt: Runtime, conn: Connection, workflow: Workflow, run: dict[str, Any], policy: str | SendEvent
) -> Any:
    """The start's decision on the caller's connection. Under a rate limit it runs in a
    savepoint: a refusal (RateLimited) undoes what it wrote (the key row) and leaves the
    caller's transaction usable."""
    if workflow.rate_limit is None:
        return decide_start_txn(rt, conn, workflow, run, policy)
    with conn.begin_nested():
        return decide_start_txn(rt, conn, workflow, run, policy)


def _same_database(conn: Connection, rt: Runtime) -> bool:
    theirs, ours = conn.engine.url, rt.db.engine.url
    return (theirs.host, theirs.port, theirs.database) == (ours.host, ours.port, ours.database)


def _after_outcome(session: Session, on_commit: Callable[[], None]) -> None:
    """Call ``on_commit`` when the session commits, unless it rolls back first."""
    rolled_back: list[bool] = []

    def committed(_session: Session) -> None:
        if not rolled_back:
            on_commit()

    event.listen(session, "after_commit", committed, once=True)
    event.listen(session, "after_rollback", lambda _s: rolled_back.append(True), once=True)
