"""Atomic steps (issue 40): a step's writes on ``current_run().connection`` commit with durable's
record of the step, in one transaction, or not at all. A step that raises, is cancelled, is taken
over (its fence moved on), waits or snoozes keeps none of its writes; starts and events sent from
inside the step join its transaction. Real PostgreSQL and SQLite; the steps run through
``run_message`` (as a worker runs a message) in the test's thread, and through a real worker."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.orm import registry

from durable_celery import current_run
from durable_celery.errors import InvalidArgument, InvalidDefinition
from durable_celery.testing import wait_for, worker
from tests.integration.core.helpers import take_over_run

pytestmark = pytest.mark.timeout(60)

meta = MetaData()
ledger = Table(
    "test_ledger", meta, Column("run_id", String(64)), Column("amount", Integer), Column("note", String(50))
)


@pytest.fixture(params=["postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    """Atomic steps need PostgreSQL (Capability.ATOMIC_STEPS; SQLite's test is the last here)."""
    return str(request.param)


@pytest.fixture
def durable(make_durable: Any) -> Any:
    """A Durable whose database also holds the application's ``test_ledger`` table."""
    made = make_durable()
    with made.db.begin() as conn:
        meta.create_all(conn)
    return made


class Entry:
    """A ledger entry, mapped on the ledger table for the ORM test."""

    def __init__(self, **values: Any) -> None:
        for name, value in values.items():
            setattr(self, name, value)


registry().map_imperatively(Entry, ledger, primary_key=[ledger.c.run_id, ledger.c.amount])


def _entries(durable: Any, run_id: str | None = None) -> list[Any]:
    query = select(ledger.c.run_id, ledger.c.amount, ledger.c.note).order_by(ledger.c.amount)
    if run_id is not None:
        query = query.where(ledger.c.run_id == run_id)
    with durable.db.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(query)]


def _book(amount: int, note: str = "") -> None:
    current_run().connection.execute(insert(ledger).values(run_id=current_run().id, amount=amount, note=note))


def test_a_completed_atomic_steps_writes_commit_with_its_record(durable: Any) -> None:
    pay = durable.workflow("pay")

    @pay.step(atomic=True)
    def charge(amount: int) -> dict[str, int]:
        _book(amount)
        return {"charged": amount}

    run_id = durable.start(pay, {"amount": 7})
    assert durable.run_message("pay", 0, run_id) == "completed"
    assert _entries(durable, run_id) == [(run_id, 7, "")]
    assert durable.get_run(run_id).output == {"charged": 7}


def test_a_step_that_raises_keeps_none_of_its_writes_and_its_retry_writes_once(durable: Any) -> None:
    pay = durable.workflow("pay")
    tries: list[int] = []

    @pay.step(atomic=True, retry=2, backoff=0.1)
    def charge(amount: int) -> None:
        tries.append(1)
        _book(amount, f"try {len(tries)}")
        if len(tries) == 1:
            raise ConnectionError("the provider hung up")

    run_id = durable.start(pay, {"amount": 5})
    assert durable.run_message("pay", 0, run_id) == "retrying"
    assert _entries(durable, run_id) == []  # the first attempt's write was rolled back
    (failed,) = durable.list_steps(run_id)
    assert failed.status == "failed" and "the provider hung up" in failed.error["message"]
    _due_now(durable, run_id)
    assert durable.run_message("pay", 0, run_id) == "completed"
    assert _entries(durable, run_id) == [(run_id, 5, "try 2")]


def _due_now(durable: Any, run_id: str) -> None:
    from sqlalchemy import update

    from durable_celery.store.schema import runs

    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(due_at=func.now()))


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
def test_a_step_whose_run_was_taken_over_or_cancelled_mid_step_keeps_none_of_its_writes(
    durable: Any, how: str
) -> None:
    pay = durable.workflow("pay")

    @pay.step(atomic=True)
    def charge(amount: int) -> None:
        _book(amount)
        take_over_run(durable, current_run().id, how)  # another worker took it, or a cancel came

    run_id = durable.start(pay, {"amount": 3})
    assert durable.run_message("pay", 0, run_id) == how
    assert _entries(durable, run_id) == []
    assert durable.list_steps(run_id) == []  # and no record of the step either


def test_a_step_that_waits_keeps_nothing_from_before_the_wait_and_commits_once_after(durable: Any) -> None:
    pay = durable.workflow("pay")

    @pay.step(atomic=True)
    def charge(amount: int) -> str:
        _book(amount, "before")
        approved = current_run().wait_for_event("approved")
        _book(amount + 1, "after")
        return str(approved)

    run_id = durable.start(pay, {"amount": 1})
    assert durable.run_message("pay", 0, run_id) == "waiting"
    assert _entries(durable, run_id) == []
    assert durable.send_event(run_id, "approved", "yes")
    assert durable.run_message("pay", 0, run_id) == "completed"
    # The step ran again from the top, as every step does after a wait: its writes once.
    assert _entries(durable, run_id) == [(run_id, 1, "before"), (run_id, 2, "after")]


def test_the_orm_session_writes_in_the_steps_transaction(durable: Any) -> None:
    pay = durable.workflow("pay")
    failing: list[bool] = [True]

    @pay.step(atomic=True, retry=2, backoff=0.1)
    def charge(amount: int) -> None:
        session = current_run().session()
        session.add(Entry(run_id=current_run().id, amount=amount, note="orm"))
        if failing[0]:  # a commit commits nothing of the step's transaction: durable's record does
            session.commit()
        if failing.pop():
            raise RuntimeError("after the session's commit")

    run_id = durable.start(pay, {"amount": 9})
    assert durable.run_message("pay", 0, run_id) == "retrying"
    assert _entries(durable, run_id) == []
    failing.append(False)
    _due_now(durable, run_id)
    assert durable.run_message("pay", 0, run_id) == "completed"
    assert _entries(durable, run_id) == [(run_id, 9, "orm")]


def test_starts_and_events_inside_an_atomic_step_join_its_transaction(durable: Any) -> None:
    notify = durable.workflow("notify")
    notify.step(lambda amount: {"told": amount}, name="tell")
    listen = durable.workflow("listen")

    @listen.step
    def hear() -> Any:
        return current_run().wait_for_event("paid")

    pay = durable.workflow("pay")
    failing = [True, False]

    @pay.step(atomic=True, retry=2, backoff=0.1)
    def charge(amount: int, listener: str) -> None:
        notify.start({"amount": amount}, key=f"pay:{current_run().id}")
        durable.send_event(listener, "paid", amount, buffer=True)
        if failing.pop(0):
            raise RuntimeError("declined")

    listener = durable.start(listen)
    run_id = durable.start(pay, {"amount": 4, "listener": listener})
    assert durable.run_message("pay", 0, run_id) == "retrying"
    assert durable.list_runs(workflow="notify") == []  # the start was rolled back with the step
    assert durable.run_message("listen", 0, listener) == "waiting"  # and so was the event
    _due_now(durable, run_id)
    assert durable.run_message("pay", 0, run_id) == "completed"
    (told,) = durable.list_runs(workflow="notify")
    assert told.key == f"pay:{run_id}"
    assert durable.run_message("listen", 0, listener) == "completed"
    assert durable.get_run(listener).output == 4


def test_connection_outside_an_atomic_step_says_how_to_get_one(durable: Any) -> None:
    plain = durable.workflow("plain")
    said: list[str] = []

    @plain.step
    def look() -> None:
        with pytest.raises(InvalidArgument) as refused:
            current_run().connection  # noqa: B018
        said.append(str(refused.value))

    durable.run_message("plain", 0, durable.start(plain))
    assert "atomic=True" in said[0] and "'look'" in said[0]


def test_atomic_is_true_or_false(durable: Any) -> None:
    with pytest.raises(InvalidDefinition):
        durable.workflow(f"w{uuid.uuid4().hex[:6]}").step(lambda: None, atomic="yes")


def test_a_one_step_workflow_from_a_function_may_be_atomic(durable: Any) -> None:
    @durable.workflow(atomic=True)
    def book_one(amount: int) -> None:
        _book(amount)

    run_id = book_one.start({"amount": 2})
    assert book_one.steps[0].atomic is True
    assert durable.run_message("book_one", 0, run_id) == "completed"
    assert _entries(durable, run_id) == [(run_id, 2, "")]


def test_an_atomic_step_goes_on_inline_to_the_next_through_a_worker(durable: Any) -> None:
    pay = durable.workflow("pay")

    @pay.step(atomic=True)
    def charge(amount: int) -> None:
        _book(amount, "charge")

    @pay.step(atomic=True)
    def receipt(amount: int) -> dict[str, int]:
        _book(amount * 10, "receipt")
        return {"count": current_run().connection.execute(select(func.count()).select_from(ledger)).scalar()}

    run_id = durable.start(pay, {"amount": 6})
    with worker(durable):
        run = wait_for(durable, run_id, timeout=30)
    assert run.status == "completed"
    assert _entries(durable, run_id) == [(run_id, 6, "charge"), (run_id, 60, "receipt")]
    assert [s.name for s in durable.list_steps(run_id)] == ["charge", "receipt"]


def test_sqlite_refuses_a_start_of_a_workflow_with_atomic_steps_and_writes_nothing(tmp_path: Any) -> None:
    from celery import Celery

    from durable_celery import Durable, Unsupported

    made = Durable(Celery("lite", broker="memory://", set_as_current=False), f"sqlite:///{tmp_path}/d.db")
    try:
        made.migrate()
        pay = made.workflow("pay")
        pay.step(lambda: None, name="charge", atomic=True)
        with pytest.raises(Unsupported) as refused:
            pay.start()
        assert "ATOMIC_STEPS" in str(refused.value) and "'pay'" in str(refused.value)
        assert made.list_runs() == []
    finally:
        made.db.dispose()


def test_heartbeats_of_a_long_atomic_step_go_on_while_its_transaction_is_open(durable: Any) -> None:
    """The heartbeats write on durable's pool, not on the step's connection, and the step's
    transaction does not touch the run's row until its record: nothing waits for the other."""
    from durable_celery.store.schema import runs

    pay = durable.workflow("pay")
    beats: list[Any] = []

    def heartbeat_at(run_id: str) -> Any:
        with durable.db.engine.connect() as conn:  # another connection than the step's
            return conn.execute(select(runs.c.heartbeat_at).where(runs.c.id == run_id)).scalar()

    @pay.step(atomic=True)
    def charge(amount: int) -> None:
        _book(amount)
        beats.append(heartbeat_at(current_run().id))
        interval = durable.settings.heartbeat_interval
        deadline = time.monotonic() + 4 * interval
        while time.monotonic() < deadline:  # the heartbeat thread's beats land meanwhile
            time.sleep(interval / 4)
        current_run().heartbeat()  # and the step's own beat does not wait for its transaction
        beats.append(heartbeat_at(current_run().id))

    run_id = durable.start(pay, {"amount": 1})
    assert durable.run_message("pay", 0, run_id) == "completed"
    assert beats[1] > beats[0]
    assert _entries(durable, run_id) == [(run_id, 1, "")]


def test_a_steps_timeout_ends_its_transaction_even_in_a_blocked_statement(durable: Any) -> None:
    """A statement stops at the step's timeout (statement_timeout of its transaction): the step
    fails, its writes roll back, and its session no longer waits on the lock."""
    from sqlalchemy import text

    with durable.db.begin() as conn:
        conn.execute(text("CREATE TABLE test_balance (id int PRIMARY KEY, total int)"))
        conn.execute(text("INSERT INTO test_balance VALUES (1, 0)"))
    pay = durable.workflow("pay")

    @pay.step(atomic=True, timeout=1.0)
    def charge(amount: int) -> None:
        _book(amount)
        current_run().connection.execute(
            text("UPDATE test_balance SET total = total + :a WHERE id = 1"), {"a": 1}
        )

    run_id = durable.start(pay, {"amount": 1})
    with durable.db.engine.connect() as holder:  # holds the balance row's lock past the timeout
        holder.execute(text("SELECT total FROM test_balance WHERE id = 1 FOR UPDATE"))
        began = time.monotonic()
        assert durable.run_message("pay", 0, run_id) == "failed"
        took = time.monotonic() - began
        waiting = holder.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        ).scalar()
        holder.rollback()
    assert took < 10 and waiting == 0
    (step,) = durable.list_steps(run_id)
    assert step.status == "failed" and _entries(durable, run_id) == []
    assert "timeout" in step.error["message"], step.error


def test_an_atomic_steps_limits_go_with_its_begin_and_end_with_its_transaction(durable: Any) -> None:
    """The step's transaction opens with its limits in one query, READ COMMITTED whatever the
    database's default; its record is one statement before the COMMIT; and the connection goes
    back to the pool with the database's own settings."""
    from contextlib import ExitStack

    from sqlalchemy import event, text

    show = (
        "SELECT pg_backend_pid(), current_setting('transaction_isolation'), setting FROM pg_settings"
        " WHERE name IN ('statement_timeout', 'idle_in_transaction_session_timeout') ORDER BY name DESC"
    )
    with durable.db.begin() as conn:  # this test's own database
        name = durable.db.engine.url.database
        conn.execute(text(f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'"))
    durable.db.engine.dispose()  # new connections take the database's default
    pay = durable.workflow("pay")

    @pay.step(atomic=True, timeout=2.5)
    def charge(amount: int) -> list[list[Any]]:
        _book(amount)
        return [list(row) for row in current_run().connection.execute(text(show))]

    seen: list[str] = []

    def statement(conn: Any, cursor: Any, sql: str, *_: Any) -> None:
        seen.append(" ".join(sql.split()[:2]))

    def commit(conn: Any) -> None:
        seen.append("COMMIT")

    run_id = durable.start(pay, {"amount": 3})
    event.listen(durable.db.engine, "before_cursor_execute", statement)
    event.listen(durable.db.engine, "commit", commit)
    try:
        assert durable.run_message("pay", 0, run_id) == "completed"
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", statement)
        event.remove(durable.db.engine, "commit", commit)
    (pid, isolation, statement_ms), (_, _, idle_ms) = durable.get_run(run_id).output
    assert (isolation, statement_ms, idle_ms) == (
        "read committed",
        "2500",
        str(int(durable.runtime.settings.stale_lock_timeout * 1000)),
    )
    assert seen[seen.index("BEGIN ISOLATION") :] == [
        "BEGIN ISOLATION",
        "INSERT INTO",
        "SELECT pg_backend_pid(),",
        "WITH recorded",
        "COMMIT",
    ]
    with ExitStack() as held:  # the pool's connections until the step's own
        for _ in range(2 * durable.db.engine.pool.size()):
            conn = held.enter_context(durable.db.engine.connect())
            rows = conn.execute(text(show.replace("setting FROM", "setting, reset_val FROM"))).all()
            if rows[0][0] == pid:
                assert [(row[2], row[3]) for row in rows] == [(row[3], row[3]) for row in rows]
                break
        else:
            pytest.fail("the step's connection was not in the pool")


def test_an_atomic_step_on_another_database_is_refused_when_defined(durable: Any) -> None:
    pay = durable.workflow("pay")
    pay.step(lambda amount: None, name="here", atomic=durable.db.engine)  # durable's own: fine
    elsewhere = "postgresql://postgres@127.0.0.1:5432/the_shops_own_database"
    with pytest.raises(InvalidDefinition) as refused:
        pay.step(lambda amount: None, name="there", atomic=elsewhere)
    message = str(refused.value)
    assert "'there'" in message and "the_shops_own_database" in message and "\n" not in message
    assert [s.name for s in pay.steps] == ["here"]  # nothing was added


def test_a_concurrency_limited_atomic_step_frees_its_slot_on_commit_and_on_rollback(durable: Any) -> None:
    pay = durable.workflow("pay", concurrency={"limit": 1, "key": "account:{account}"})

    @pay.step(atomic=True)
    def charge(account: int, amount: int) -> None:
        _book(amount)
        if amount < 0:
            raise ValueError("a negative amount")  # rolled back: the slot is freed all the same

    ids = [durable.start(pay, {"account": 1, "amount": a}) for a in (-1, 2, 3)]
    with worker(durable, concurrency=2):
        ended = [wait_for(durable, run_id, timeout=30) for run_id in ids]
    assert [r.status for r in ended] == ["failed", "completed", "completed"]
    assert sorted(a for _, a, _ in _entries(durable)) == [2, 3]


def test_an_atomic_steps_compensation_is_atomic_too(durable: Any) -> None:
    pay = durable.workflow("pay")
    undo_tries: list[int] = []

    def refund(amount: int) -> None:
        undo_tries.append(1)
        _book(-amount, f"refund {len(undo_tries)}")
        if len(undo_tries) == 1:
            raise ConnectionError("the bank hung up")  # this refund's write is rolled back

    pay.step(lambda amount: _book(amount, "charge"), name="charge", atomic=True, compensate=refund)

    @pay.step
    def ship(amount: int) -> None:
        raise ValueError("out of stock")

    run_id = durable.start(pay, {"amount": 8})
    assert durable.run_message("pay", 0, run_id) == "running"
    assert durable.run_message("pay", 1, run_id) == "compensating"
    assert durable.run_message("pay", 0, run_id, compensate=True) == "compensating"  # will retry
    assert _entries(durable, run_id) == [(run_id, 8, "charge")]
    _due_now(durable, run_id)
    assert durable.run_message("pay", 0, run_id, compensate=True) == "compensated"
    assert _entries(durable, run_id) == [(run_id, -8, "refund 2"), (run_id, 8, "charge")]
