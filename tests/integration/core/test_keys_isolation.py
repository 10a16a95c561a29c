"""Two callers' transactions start one key at once under REPEATABLE READ and SERIALIZABLE, as
docs/keys.md ("Isolation levels") says: the second fails with a serialization failure
(SQLAlchemy's OperationalError around psycopg's SerializationFailure) and writes nothing; its
retry answers with the first start's run. PostgreSQL only: SQLite has one writer at a time."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from psycopg.errors import SerializationFailure
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from durable_celery import KeyTaken

pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("backend", ["postgres"])]


def _blocked_on_a_lock(durable: Any, pid: int) -> bool:
    with durable.db.engine.connect() as conn:
        found = conn.execute(
            text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        )
        return found.scalar() == "Lock"


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
@pytest.mark.parametrize("on_duplicate", ["use_existing", "error"])
def test_a_concurrent_same_key_start_fails_to_serialize_and_its_retry_gets_the_holder(
    durable, level, on_duplicate
):
    wf = durable.workflow("article", on_duplicate=on_duplicate)

    @wf.step
    def only(n=0):
        return n

    engine = create_engine(durable.db.url, isolation_level=level)
    outcome: dict[str, Any] = {}
    second_pid: list[int] = []
    try:
        first = engine.connect()
        first_tx = first.begin()
        holder = durable.start(wf, {"n": 1}, key="article:1", connection=first)  # not committed yet

        def second_start() -> None:
            with engine.connect() as conn:
                tx = conn.begin()
                second_pid.append(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())  # its snapshot
                try:
                    outcome["id"] = durable.start(wf, {"n": 2}, key="article:1", connection=conn)
                    tx.commit()
                except OperationalError as exc:
                    outcome["error"] = exc
                    tx.rollback()

        racer = threading.Thread(target=second_start)
        racer.start()
        deadline = time.monotonic() + 30
        while not (second_pid and _blocked_on_a_lock(durable, second_pid[0])):  # waits on the key row
            assert racer.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.01)
        first_tx.commit()
        first.close()
        racer.join(30)

        assert "id" not in outcome
        assert isinstance(outcome["error"].orig, SerializationFailure)
        assert [r.id for r in durable.list_runs()] == [holder]  # the failed start wrote nothing
        assert durable.activity(kinds=["key_duplicate"]) == []

        # The retry, as docs/keys.md writes it, answers as a duplicate of the committed start.
        with engine.connect() as conn, conn.begin():
            if on_duplicate == "use_existing":
                assert durable.start(wf, {"n": 2}, key="article:1", connection=conn) == holder
            else:
                with pytest.raises(KeyTaken) as taken:
                    durable.start(wf, {"n": 2}, key="article:1", connection=conn)
                assert taken.value.holder_id == holder
        assert [r.id for r in durable.list_runs()] == [holder]
    finally:
        engine.dispose()
