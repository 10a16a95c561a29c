"""A database that is down gives one clear error, never a half-written start, and never the run's
input or SQL in a message; errors keep bound parameters out, reprs keep the password out.

The outage is real: a private PostgreSQL server (tests/pgserver.py) is killed and started again.
"""

from __future__ import annotations

import pickle
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc
from celery import Celery
from sqlalchemy import text

from durable_celery import DatabaseUnavailable, Durable, DurableError
from durable_celery.store import db as store_db
from tests.pgserver import PgServer, free_port, pg_server  # noqa: F401

pytestmark = pytest.mark.timeout(60)

SECRET = "4111-1111-SECRET"  # stands for a run's input: it must show in no message
TABLES = ("durable_runs", "durable_steps", "durable_keys", "durable_activity", "durable_events")


def make(url: str) -> Durable:
    durable = Durable(Celery("down", broker="memory://"), url, upkeep=False)
    wf = durable.workflow("charge")

    @wf.step
    def pay(card: str) -> str:
        return card[-4:]

    return durable


def assert_clean(exc: DatabaseUnavailable) -> None:
    message = str(exc)
    assert isinstance(exc, DurableError)
    assert isinstance(exc.__cause__, psycopg.Error), repr(exc.__cause__)
    assert "\n" not in message
    assert SECRET not in message
    for leak in ("INSERT", "SELECT", "UPDATE", "[SQL", "parameters"):
        assert leak not in message, message


def counts(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}  # type: ignore[index]


def test_start_with_nothing_listening_raises_database_unavailable():
    port = free_port()
    durable = make(f"postgresql://postgres:hunter2@127.0.0.1:{port}/app")
    with pytest.raises(DatabaseUnavailable) as info:
        durable.start("charge", {"card": SECRET}, key=f"card:{SECRET}")
    assert_clean(info.value)
    message = str(info.value)
    assert f"postgresql+psycopg://postgres:***@127.0.0.1:{port}/app" in message
    assert "hunter2" not in message and "Connection refused" in message
    assert info.value.url == f"postgresql+psycopg://postgres:***@127.0.0.1:{port}/app"
    assert str(pickle.loads(pickle.dumps(info.value))) == message

    with pytest.raises(DatabaseUnavailable):
        durable.get_run("0190c2c6-0000-7000-8000-000000000000")
    with pytest.raises(DatabaseUnavailable):
        durable.list_runs()


def test_an_outage_writes_nothing_and_start_works_once_the_server_is_back(pg_server, monkeypatch):  # noqa: F811
    # Pooled connections are not pinged before use, so the first start after the crash runs its
    # INSERT (with the input bound) on a dead connection: the error users saw carried both.
    monkeypatch.setattr(store_db, "PING_AFTER_IDLE", 3600.0)
    durable = make(pg_server.url)
    durable.migrate()
    keyed = durable.start("charge", {"card": "1"}, key="card:1")
    durable.start("charge", {"card": "2"})
    assert durable.start("charge", {"card": "1"}, key="card:1") == keyed  # the key's holder answers
    before = counts(pg_server.url)
    assert before["durable_runs"] == 2 and before["durable_keys"] == 1

    pg_server.stop(mode="immediate")
    with pytest.raises(DatabaseUnavailable) as on_dead_connection:
        durable.start("charge", {"card": SECRET}, key=f"card:{SECRET}")
    assert_clean(on_dead_connection.value)
    for attempt in ({"key": f"card:{SECRET}"}, {"key": "card:1"}, {}):  # new key, held key, no key
        with pytest.raises(DatabaseUnavailable) as refused:
            durable.start("charge", {"card": SECRET}, **attempt)
        assert_clean(refused.value)
    with pytest.raises(DatabaseUnavailable):
        durable.get_run(keyed)

    pg_server.start()
    assert counts(pg_server.url) == before  # nothing half-written
    again = durable.start("charge", {"card": SECRET}, key=f"card:{SECRET}")
    assert durable.get_run(again).input == {"card": SECRET}
    assert durable.start("charge", {"card": "1"}, key="card:1") == keyed
    after = counts(pg_server.url)
    assert after["durable_runs"] == 3 and after["durable_keys"] == 2
    durable.db.dispose()


def test_driver_errors_carry_no_parameters_and_are_not_outages(durable):
    with pytest.raises(sqlalchemy.exc.IntegrityError) as info, durable.db.begin() as conn:
        conn.execute(text("CREATE TEMPORARY TABLE cards (id integer PRIMARY KEY, number text)"))
        insert = text("INSERT INTO cards (id, number) VALUES (1, :number)")
        conn.execute(insert, {"number": SECRET})
        conn.execute(insert, {"number": SECRET + "-again"})
    assert not isinstance(info.value, DatabaseUnavailable)
    assert "[SQL parameters hidden due to hide_parameters=True]" in str(info.value)
    assert SECRET not in str(info.value)
    assert durable.list_runs() == []  # the connection was not taken for a lost one


def test_a_statement_timeout_is_no_outage(pg_url: str):
    durable = make(pg_url)
    with pytest.raises(sqlalchemy.exc.OperationalError) as info, durable.db.begin() as conn:
        conn.execute(text("SET LOCAL statement_timeout = '50ms'"))
        conn.execute(text("SELECT pg_sleep(:seconds)"), {"seconds": 5})
    assert isinstance(info.value.orig, psycopg.errors.QueryCanceled)
    assert not isinstance(info.value, DatabaseUnavailable)
    assert durable.list_runs() == []
    durable.db.dispose()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:secret@127.0.0.1:1/x",
        "postgresql://u@127.0.0.1:1/x?password=secret&sslmode=disable",
    ],
)
def test_reprs_mask_the_password(url: str):
    durable: Any = make(url)
    for shown in (repr(durable.settings), str(durable.settings), repr(durable)):
        assert "secret" not in shown, shown
        assert "***" in shown
