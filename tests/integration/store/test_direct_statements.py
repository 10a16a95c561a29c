"""The hot statements (start, claim, a step's record) run straight on psycopg on a ``single()``
connection: same rows, same values, same errors as through SQLAlchemy, and whoever watches
SQLAlchemy's statements still sees every one. PostgreSQL only."""

from __future__ import annotations

import logging
import time
import uuid
from datetime import datetime
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import IntegrityError

from durable_celery import current_run
from durable_celery.core.runs import new_run
from durable_celery.errors import DatabaseUnavailable
from durable_celery.store import direct, queries
from durable_celery.testing import wait_for, worker

pytestmark = [pytest.mark.timeout(90)]


@pytest.fixture
def backend() -> str:
    return "postgres"


class Watch:
    """A ``before_cursor_execute`` listener on a Durable's engine: the statements it saw."""

    def __init__(self, durable: Any) -> None:
        self.engine, self.seen = durable.db.engine, []
        event.listen(self.engine, "before_cursor_execute", self.saw)

    def saw(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        self.seen.append(statement)

    def close(self) -> None:
        event.remove(self.engine, "before_cursor_execute", self.saw)


def define(durable: Any) -> Any:
    wf = durable.workflow("direct_wf")

    @wf.step
    def first(order: dict[str, Any], note: str = "é ✓") -> dict[str, Any]:
        return {"total": sum(order["lines"]), "note": note, "nested": [{"a": None}, 1.5, True]}

    @wf.step
    def second(**_: Any) -> None:  # recorded on a single() connection: None goes in as JSON null
        return None

    @wf.step
    def third(order: dict[str, Any], note: str = "é ✓") -> str:
        return f"{len(order['lines'])}:{note}:{current_run().step}"

    return wf


def stored(durable: Any, run_id: str) -> list[Any]:
    """How the run's and its steps' JSON values are stored: SQL NULL or a JSON type."""
    with durable.db.engine.connect() as conn:
        query = """SELECT 'run', output IS NULL, jsonb_typeof(output), error IS NULL, NULL
                   FROM durable_runs WHERE id = :i
                   UNION ALL
                   SELECT name, output IS NULL, jsonb_typeof(output), error IS NULL, logs IS NULL
                   FROM durable_steps WHERE run_id = :i"""
        return sorted(tuple(row) for row in conn.execute(text(query), {"i": run_id}))


def run_once(durable: Any, wf: Any, key: str) -> dict[str, Any]:
    """Start a keyed run, start it again (answered by the key), run it; what was recorded."""
    data = {"order": {"lines": [1, 2, 3], "id": "o-1"}}
    run_id = durable.start(wf, data, key=key)
    assert durable.start(wf, data, key=key) == run_id  # use_existing: the holder's id
    with worker(durable):
        wait_for(durable, run_id)
    run = durable.get_run(run_id)
    steps = [(s.step_index, s.name, s.status, s.attempt, s.output) for s in durable.list_steps(run_id)]
    keys = [k.holder_id == run_id for k in durable.list_keys(workflow="direct_wf") if k.key == key]
    return {
        "status": run.status,
        "output": run.output,
        "input": run.input,
        "steps": steps,
        "keys": keys,
        "stored": stored(durable, run_id),
    }


def test_a_run_records_the_same_through_psycopg_as_through_sqlalchemy(make_durable):
    unwatched = make_durable()
    wf = define(unwatched)
    key = f"k-{uuid.uuid4().hex[:6]}"
    direct_result = run_once(unwatched, wf, key)
    assert any(c is not None for c in direct._compiled.values())  # the direct path ran

    watched = make_durable()
    wf2 = define(watched)
    watch = Watch(watched)
    try:
        watched_result = run_once(watched, wf2, key + "w")
    finally:
        watch.close()
    assert any("durable_keys" in s and "ON CONFLICT" in s for s in watch.seen)  # the start, seen
    assert any(s.lstrip().startswith("UPDATE durable_runs") for s in watch.seen)  # the claims, seen
    assert direct_result["status"] == "completed"
    assert direct_result["keys"] == [True] and direct_result["output"] == "3:é ✓:third"
    assert direct_result["steps"][0][4] == {"total": 6, "note": "é ✓", "nested": [{"a": None}, 1.5, True]}
    assert direct_result["steps"][1][4] is None
    assert ("second", False, "null", True, False) in direct_result["stored"]  # None output: JSON null
    assert direct_result == watched_result


def test_a_listener_on_every_engine_and_sqlalchemys_log_see_the_statements(make_durable, caplog):
    durable = make_durable()
    wf = define(durable)
    run_ids = [durable.start(wf, {"order": {"lines": [n]}}) for n in range(2)]
    seen: list[str] = []

    def saw(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    event.listen(Engine, "before_cursor_execute", saw)
    try:
        with durable.db.single() as conn:
            assert queries.claim_run(durable.db, conn, run_ids[0], 0, "node-a") is not None
    finally:
        event.remove(Engine, "before_cursor_execute", saw)
    assert [s for s in seen if s.lstrip().startswith("UPDATE durable_runs")]
    with caplog.at_level(logging.INFO, logger="sqlalchemy.engine"), durable.db.single() as conn:
        assert queries.claim_run(durable.db, conn, run_ids[1], 0, "node-a") is not None
    assert any(r.getMessage().lstrip().startswith("UPDATE durable_runs") for r in caplog.records)


def test_a_claim_row_has_the_values_and_types_sqlalchemy_gives(make_durable):
    durable = make_durable()
    wf = define(durable)
    data = {"order": {"lines": [4], "id": "x"}}
    plain_id, watched_id = durable.start(wf, data), durable.start(wf, data)
    db = durable.db
    with db.single() as conn:
        row = queries.claim_run(db, conn, plain_id, 0, "node-a", timeout=60)
    watch = Watch(durable)
    try:
        with db.single() as conn:
            expected = queries.claim_run(db, conn, watched_id, 0, "node-a", timeout=60)
    finally:
        watch.close()
    assert row is not None and expected is not None
    got, want = dict(row._mapping), dict(expected._mapping)
    assert got.pop("id") == plain_id and want.pop("id") == watched_id
    assert got == want
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}
    assert row.fence == 1 and row.input == data and row.step_name == "first"
    with db.single() as conn:  # claimed already: nothing due, no row
        assert queries.claim_run(db, conn, plain_id, 0, "node-b") is None
    with db.engine.connect() as conn:
        started = conn.execute(text("SELECT started_at FROM durable_runs WHERE id = :i"), {"i": plain_id})
        assert isinstance(started.scalar_one(), datetime)


def test_a_statement_error_is_sqlalchemys_and_the_connection_stays_usable(make_durable):
    durable = make_durable()
    wf = define(durable)
    run = new_run(durable.runtime.default_queue(), wf, {"order": {"lines": [1]}}, None)
    db = durable.db
    with db.single() as conn:
        queries.insert_run_txn(db, conn, run)
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with pytest.raises(IntegrityError) as caught:
            queries.insert_run_txn(db, conn, run)  # the same id again
        assert isinstance(caught.value.orig, psycopg.errors.UniqueViolation)
        assert "order" not in str(caught.value)  # the run's input is not in the message
        assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() == pid
    assert durable.get_run(run["id"]).status == "pending"


def test_in_a_transaction_the_statements_take_sqlalchemys_path(make_durable):
    durable = make_durable()
    wf = define(durable)
    db = durable.db
    first_run = new_run(durable.runtime.default_queue(), wf, {"order": {"lines": [1]}}, None)
    second_run = new_run(durable.runtime.default_queue(), wf, {"order": {"lines": [2]}}, None)
    with db.begin() as conn:
        queries.insert_run_txn(db, conn, first_run)  # a statement of no rows
        row = queries.claim_run(db, conn, first_run["id"], 0, "node-a")
        assert row is not None and row.fence == 1 and row.input == {"order": {"lines": [1]}}
        queries.insert_run_txn(db, conn, second_run)
    assert durable.get_run(second_run["id"]).status == "pending"
    assert durable.get_run(first_run["id"]).status == "running"


def test_a_lost_connection_is_database_unavailable_and_is_dropped(make_durable):
    durable = make_durable()
    wf = define(durable)
    run_id = durable.start(wf, {"order": {"lines": [1]}})
    db = durable.db
    with pytest.raises(DatabaseUnavailable), db.single() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with db.engine.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        deadline = time.monotonic() + 10
        while _backend_alive(db, pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        queries.claim_run(db, conn, run_id, 0, "node-a")
    with db.single() as conn:  # a fresh connection, and the claim goes through
        assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
        assert queries.claim_run(db, conn, run_id, 0, "node-a") is not None


def _backend_alive(db: Any, pid: int) -> bool:
    with db.engine.connect() as conn:
        query = text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p")
        return bool(conn.execute(query, {"p": pid}).scalar_one())
