"""Starting a run inside the caller's own SQLAlchemy transaction."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, event
from sqlalchemy.orm import Session

from .errors import InvalidArgument
from .store import queries

if TYPE_CHECKING:
    from .app import Durable
    from .definition import Workflow


def callers_connection(connection: Any) -> tuple[Connection, Session | None]:
    """The Connection to write on, and the Session it came from (if it came from one)."""
    if isinstance(connection, Session):
        return connection.connection(), connection
    if isinstance(connection, Connection):
        if not connection.in_transaction():
            raise InvalidArgument("connection= must be inside an open transaction (conn.begin())")
        return connection, None
    raise InvalidArgument(
        f"connection= takes a SQLAlchemy Connection or Session, not {type(connection).__name__}"
    )


def insert_in_callers_transaction(
    durable: Durable, connection: Any, values: dict[str, Any], workflow: Workflow
) -> None:
    """Insert the run on the caller's connection; it is published only once they commit.

    With a Session the message goes out from its ``after_commit`` hook. A bare Connection has no
    after-commit hook, so the run is left unsent and the relay sends it once the commit is visible.
    """
    conn, session = callers_connection(connection)
    if conn.engine.url.render_as_string(hide_password=False) != durable.db.url and not _same_db(
        conn, durable
    ):
        raise InvalidArgument("connection= must be on the database Durable uses")
    if session is not None:
        values = {**values, "published": True}
    queries.insert_run_txn(conn, values)
    if session is not None:

        def publish(_session: Session) -> None:
            durable.publish(workflow, 0, values["id"], 1, values["key"])

        event.listen(session, "after_commit", publish, once=True)


def _same_db(conn: Connection, durable: Durable) -> bool:
    theirs, ours = conn.engine.url, durable.db.engine.url
    return (theirs.host, theirs.port, theirs.database) == (ours.host, ours.port, ours.database)
