"""Run control's records, exactly: what cancel, retry, rerun, release_key and events write,
refuse and announce, on both backends.

Runs are put in the status a case needs by writing it directly (tests/integration/helpers.py);
messages are recorded instead of sent. Written against mutants of durable_celery/core/control.py
that the behaviour tests let through.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import delete, event, insert, select, update

from durable_celery import (
    InvalidArgument,
    InvalidStart,
    KeyContended,
    KeyTaken,
    NoKey,
    NotFinished,
    RunNotFound,
)
from durable_celery.store import event_rows
from durable_celery.store.schema import events, keys, runs
from tests.integration.helpers import (
    key_holders,
    only_entry,
    run_row,
    set_run,
    started_run,
    two_step_workflow,
)

pytestmark = pytest.mark.timeout(60)


def _failed(durable: Any, run_id: str, **values: Any) -> None:
    """The run failed in its second step, at its first attempt, after a loss and a wait."""
    error = {"type": "Boom", "message": "boom", "traceback": None}
    failed = dict(
        status="failed",
        step_index=1,
        step_name="second",
        error=error,
        finished_at=durable.db.utcnow(),
        started_at=durable.db.utcnow(),
        due_at=None,
        published=False,
        losses=2,
        deadline_at=durable.db.utcnow(),
        wait_name="approval",
        wait_until=durable.db.utcnow(),
    )
    set_run(durable, run_id, **{**failed, **values})


def test_cancel_records_why_and_refuses_a_finished_run(durable, seen):
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    bystander = durable.start(wf, {"n": 9})  # unkeyed: cancelling run_id leaves it be
    seen.clear()
    set_run(durable, run_id, status="running", locked_by="w:1:1", published=True)  # due, sent, held
    assert durable.cancel(run_id) is True
    assert durable.get_run(bystander).status == "pending"
    row = run_row(durable, run_id)
    assert (row.locked_by, row.due_at, row.published) == (None, None, False)
    assert row.finished_at is not None
    run = durable.get_run(run_id)
    assert (run.status, run.error) == (
        "cancelled",
        {"type": "Cancelled", "message": "cancelled", "traceback": None},
    )
    assert durable.cancel(run_id) is False
    assert seen.signals == [("run_finished", {"run_id": run_id, "workflow": wf.name, "status": "cancelled"})]
    seen.clear()
    done = started_run(durable, wf, seen, {"n": 2}, key="other")
    set_run(durable, done, status="completed")
    assert durable.cancel(done) is False
    assert durable.get_run(done).status == "completed"


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite: the cancel's transaction writes alone
def test_cancel_answers_false_when_the_run_finished_between_its_read_and_its_update(durable, seen):
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    finished = threading.Event()

    def finish_first(conn, cursor, statement, parameters, context, executemany):
        # The cancelling UPDATE is about to run: the run completes just before it, elsewhere.
        if not finished.is_set() and statement.lstrip().upper().startswith("UPDATE DURABLE_RUNS"):
            finished.set()
            with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as other:
                other.execute(update(runs).where(runs.c.id == run_id).values(status="completed"))

    event.listen(durable.db.engine, "before_cursor_execute", finish_first)
    try:
        assert durable.cancel(run_id) is False
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", finish_first)
    assert finished.is_set()
    assert durable.get_run(run_id).status == "completed"
    assert not [name for name, _ in seen.signals if name == "run_finished"]


@pytest.mark.parametrize("action", ["cancel", "retry", "rerun", "release_key"])
def test_control_of_an_unknown_run_names_it(durable, action):
    with pytest.raises(RunNotFound) as missing:
        getattr(durable, action)("0000-no-such-run")
    assert "0000-no-such-run" in str(missing.value)
    with pytest.raises(RunNotFound):
        getattr(durable, action)(12345)  # not a run id at all: not found, no database error


def test_retry_resumes_the_failed_step_with_a_clean_row_and_the_next_attempt(durable, seen):
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    _failed(durable, run_id)
    other = started_run(durable, wf, seen, {"n": 2}, key="other")
    _failed(durable, other)
    assert durable.retry(run_id) == run_id
    row = run_row(durable, run_id)
    assert (row.status, row.attempt, row.attempt_base, row.step_index) == ("running", 2, 1, 1)
    assert (row.error, row.finished_at, row.deadline_at, row.losses) == (None, None, None, 0)
    assert (row.wait_name, row.wait_until, row.published) == (None, None, True)
    assert row.due_at is not None
    assert seen.published == [(wf.name, 1, run_id, 2, "k")]
    assert [name for name, _ in seen.signals] == []  # it still held its key: no hand-off
    assert durable.activity(kinds=["key_retaken"]) == []
    assert run_row(durable, other).status == "failed"  # only the run asked for


def test_retry_of_a_run_that_never_started_puts_it_back_pending(durable, seen):
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    _failed(durable, run_id, started_at=None, step_index=0, step_name="first")
    durable.retry(run_id)
    assert run_row(durable, run_id).status == "pending"
    assert seen.published == [(wf.name, 0, run_id, 2, "k")]


def test_retry_of_an_unkeyed_run_announces_no_hand_off(durable, seen):
    wf = two_step_workflow(durable)
    run_id = durable.start(wf, {"n": 1})
    seen.clear()
    _failed(durable, run_id)
    durable.retry(run_id)
    assert seen.signals == []
    assert seen.published == [(wf.name, 1, run_id, 2, None)]


@pytest.mark.parametrize("status", ["pending", "completed"])
def test_retry_refuses_what_is_not_failed_and_says_why(durable, seen, status):
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, run_id, status=status)
    error = NotFinished if status == "pending" else InvalidArgument
    with pytest.raises(error) as refused:
        durable.retry(run_id)
    assert run_id in str(refused.value) and status in str(refused.value)
    assert seen.published == []


def test_retry_takes_back_a_key_that_reuse_frees_and_says_from_whom(durable, seen):
    wf = two_step_workflow(durable)  # reuse after_close: a completed holder frees the key
    first = started_run(durable, wf, seen, {"n": 1})
    _failed(durable, first)
    second = durable.start(wf, {"n": 2}, key="k")
    assert second != first
    set_run(durable, second, status="completed", finished_at=durable.db.utcnow())
    seen.clear()
    durable.retry(first)
    assert key_holders(durable, wf.name) == (first, None)
    entry = only_entry(durable, "key_retaken")
    assert (entry.run_id, entry.workflow) == (first, wf.name)
    assert entry.details == {"key": "k", "workflow": wf.name, "from": second}
    assert seen.signals == [
        ("key_handoff", {"run_id": first, "workflow": wf.name, "key": "k", "previous_id": second})
    ]


def test_retry_claims_a_released_key_afresh(durable, seen):
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    _failed(durable, run_id)
    durable.release_key(run_id)
    seen.clear()
    durable.retry(run_id)
    assert key_holders(durable, wf.name) == (run_id, None)
    entry = only_entry(durable, "key_retaken")
    assert entry.details == {"key": "k", "workflow": wf.name, "from": None}
    assert seen.signals == [
        ("key_handoff", {"run_id": run_id, "workflow": wf.name, "key": "k", "previous_id": None})
    ]


def test_retry_is_refused_while_a_newer_run_keeps_the_key(durable, seen):
    wf = two_step_workflow(durable, reuse="after_failure")
    first = started_run(durable, wf, seen, {"n": 1})
    _failed(durable, first)
    second = durable.start(wf, {"n": 2}, key="k")
    with pytest.raises(KeyTaken) as refused:
        durable.retry(first)
    assert refused.value.holder_id == second
    assert run_row(durable, first).status == "failed"


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite: the retry's transaction writes alone
@pytest.mark.parametrize("meanwhile", ["retried", "pruned"])
def test_a_retry_that_lost_a_race_says_so_and_takes_nothing(durable, seen, meanwhile):
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    _failed(durable, run_id)
    durable.release_key(run_id)  # the retry takes the key afresh, then loses its race
    done: list[bool] = []

    def race(conn, cursor, statement, parameters, context, executemany):
        # The retry read the run as failed; just before its UPDATE, elsewhere, the run is
        # retried (now running) or pruned.
        if done or not statement.startswith("UPDATE durable_runs") or "attempt_base" not in statement:
            return
        done.append(True)
        with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as other:
            if meanwhile == "retried":
                other.execute(update(runs).where(runs.c.id == run_id).values(status="running", attempt=2))
            else:
                other.execute(delete(runs).where(runs.c.id == run_id))

    event.listen(durable.db.engine, "before_cursor_execute", race)
    try:
        with pytest.raises(NotFinished if meanwhile == "retried" else RunNotFound) as lost:
            durable.retry(run_id)
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", race)
    assert done and run_id in str(lost.value)
    if meanwhile == "retried":
        assert "retried meanwhile" in str(lost.value)
        assert run_row(durable, run_id).attempt == 2
    assert durable.activity(kinds=["key_retaken"]) == []  # rolled back with the retry
    assert durable.list_keys() == []
    assert seen.published == [] and seen.signals == []


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite: the retry's transaction writes alone
def test_a_retry_gives_up_on_a_key_that_keeps_changing_hands(durable, seen):
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    other = durable.start(wf, {"n": 2})  # holds no key: it can be made to hold this one
    seen.clear()
    _failed(durable, run_id)
    flips: list[str] = []
    busy: list[bool] = []  # the hook's own statements pass through

    def flip(conn, cursor, statement, parameters, context, executemany):
        # Each time the retry looks at the key it is gone, and each time it claims it, it is
        # back (held by another run): the key changes hands under it every time.
        head = statement.lstrip().upper()
        if busy or not head.startswith(("SELECT DURABLE_KEYS", "INSERT INTO DURABLE_KEYS")):
            return
        busy.append(True)
        try:
            with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as elsewhere:
                if head.startswith("SELECT"):
                    elsewhere.execute(delete(keys).where(keys.c.workflow == wf.name, keys.c.key == "k"))
                    flips.append("gone")
                else:
                    back = {"workflow": wf.name, "key": "k", "holder_id": other, "taken_at": _now()}
                    elsewhere.execute(insert(keys).values(**back))
                    flips.append("back")
        finally:
            busy.clear()

    event.listen(durable.db.engine, "before_cursor_execute", flip)
    try:
        with pytest.raises(KeyContended) as contended:
            durable.retry(run_id)
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", flip)
    assert flips == ["gone", "back"] * 3  # MAX_HANDS tries, then it gives up
    assert str(contended.value) == f"key 'k' of '{wf.name}' changed hands 3 times"
    assert run_row(durable, run_id).status == "failed"
    assert seen.published == [] and seen.signals == []


def _now() -> Any:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc)


def test_rerun_refuses_an_unfinished_run_and_says_why(durable, seen):
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    with pytest.raises(NotFinished) as refused:
        durable.rerun(run_id)
    assert run_id in str(refused.value) and "pending" in str(refused.value)


def test_rerun_is_refused_by_a_held_key_even_an_unclaimed_debounced_one(make_durable):
    durable = make_durable()
    wf = two_step_workflow(durable, reuse="after_close", debounce={"period": 30})
    first = durable.start(wf, {"n": 1}, key="k")
    set_run(durable, first, status="completed", finished_at=durable.db.utcnow())
    saving = durable.start(wf, {"n": 2}, key="k")  # waits out its period, not yet claimed
    assert saving != first
    with pytest.raises(KeyTaken) as refused:
        durable.rerun(first)
    assert refused.value.holder_id == saving
    assert run_row(durable, saving).input == {"n": 2}  # not folded into the burst
    assert len(durable.list_runs()) == 2


def test_rerun_of_a_held_key_refuses(durable, seen):
    wf = two_step_workflow(durable)
    first = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, first, status="failed", finished_at=durable.db.utcnow())
    holder = durable.start(wf, {"n": 2}, key="k")  # after_close: the failed run freed the key
    with pytest.raises(KeyTaken) as refused:
        durable.rerun(first)
    assert refused.value.holder_id == holder
    entry = only_entry(durable, "key_duplicate")  # refused by the policy "error", whatever the workflow's
    assert (entry.details["policy"], entry.details["outcome"]) == ("error", "error")


def test_rerun_checks_the_input_against_today_s_limits(make_durable):
    roomy = make_durable("roomy")
    wf = roomy.workflow("padded")
    wf.step(lambda **data: data, name="only")
    run_id = roomy.start(wf, {"n": 1, "pad": "x" * 3000})
    set_run(roomy, run_id, status="completed", finished_at=roomy.db.utcnow())
    strict = make_durable("strict", max_input_bytes=1000)
    strict.workflow("padded").step(lambda **data: data, name="only")
    with pytest.raises(InvalidStart):
        strict.rerun(run_id)
    assert len(strict.list_runs()) == 1


def test_rerun_derives_the_key_the_workflow_derives_today(make_durable):
    before = make_durable("before")
    wf = two_step_workflow(before)
    run_id = before.start(wf, {"n": 7})
    set_run(before, run_id, status="completed", finished_at=before.db.utcnow())
    after = make_durable("after")
    two_step_workflow(after, key="order-{n}")
    fresh = after.rerun(run_id)
    assert after.get_run(fresh).key == "order-7"


def test_release_key_refuses_with_reasons_and_announces_a_release(durable, seen):
    from durable_celery import signals

    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    with pytest.raises(NotFinished) as refused:
        durable.release_key(run_id)
    assert run_id in str(refused.value) and "pending" in str(refused.value)
    set_run(durable, run_id, status="completed")
    released: list[tuple[Any, dict[str, Any]]] = []

    def receive(sender: Any, **kwargs: Any) -> None:
        kwargs.pop("signal", None)
        released.append((sender, kwargs))

    signals.key_release.connect(receive, weak=False)
    try:
        durable.release_key(run_id, by="ops")
    finally:
        signals.key_release.disconnect(receive)
    assert released == [(durable, {"run_id": run_id, "workflow": wf.name, "key": "k", "by": "ops"})]
    with pytest.raises(NoKey) as again:
        durable.release_key(run_id)
    assert run_id in str(again.value)


def _kept_events(durable: Any, run_id: str) -> list[str]:
    with durable.db.engine.connect() as conn:
        return [row.name for row in conn.execute(select(events).where(events.c.run_id == run_id))]


def test_send_event_keeps_nothing_for_a_run_not_waiting_unless_asked(durable, seen):
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    assert durable.send_event(run_id, "paid", {"amount": 1}) is False
    assert _kept_events(durable, run_id) == []
    assert durable.send_event(run_id, "paid", {"amount": 1}, buffer=True) is True
    assert _kept_events(durable, run_id) == ["paid"]


@pytest.mark.parametrize("call", ["send_event", "provide_input"])
def test_an_event_payload_that_is_not_json_is_refused_before_anything_is_written(durable, seen, call):
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    with pytest.raises(InvalidArgument):
        getattr(durable, call)(run_id, "paid", {"when": object()})
    assert _kept_events(durable, run_id) == []


@pytest.mark.parametrize("backend", ["postgres"])
def test_an_event_sent_while_the_step_parks_on_it_is_never_missed(durable, seen):
    # The step parks (event_rows.park_txn) just after send_event looked for a waiting run and
    # found none: the lock send_event holds on the run makes the park wait for its commit, so
    # the park then sees the kept event and leaves the run due. Without the lock the park
    # would commit first, see no event, and the run would wait for one it already has.
    wf = two_step_workflow(durable)
    run_id = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, run_id, status="running", fence=7, locked_by="worker-a")
    sender = threading.get_ident()
    tried: list[bool] = []

    def park(lock_timeout_ms: int | None) -> bool:
        with durable.db.engine.begin() as conn:
            if lock_timeout_ms is not None:
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{lock_timeout_ms}ms'")
            return event_rows.park_txn(durable.db, conn, run_id, 7, "worker-a", "paid", None)

    def park_meanwhile(conn, cursor, statement, parameters, context, executemany):
        if tried or threading.get_ident() != sender or "SET due_at" not in statement:
            return
        tried.append(True)  # send_event's wake found no waiting run; it has not committed
        outcome: list[Any] = []
        parker = threading.Thread(target=lambda: outcome.append(_outcome(lambda: park(300))))
        parker.start()
        parker.join()
        tried.append(outcome[0] is True)  # parked before send_event committed?

    event.listen(durable.db.engine, "after_cursor_execute", park_meanwhile)
    try:
        assert durable.send_event(run_id, "paid", {"amount": 5}, buffer=True) is True
    finally:
        event.remove(durable.db.engine, "after_cursor_execute", park_meanwhile)
    assert tried[0] is True
    if not tried[1]:  # the park waited for send_event's lock: it goes on now
        assert park(None) is True
    row = run_row(durable, run_id)
    assert (row.status, row.wait_name) == ("waiting", "paid")
    assert row.due_at is not None  # due at once: the kept event is there for it
    assert _kept_events(durable, run_id) == ["paid"]


def _outcome(call: Any) -> Any:
    try:
        return call()
    except Exception as exc:  # a lock timeout: the park waited on send_event's lock
        return exc
