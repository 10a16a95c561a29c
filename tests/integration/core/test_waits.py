"""Waiting inside a step: sleep, inputs and snooze park the run and free the worker."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pytest

from durable_celery import InvalidArgument, current_run
from durable_celery.testing import wait_for, worker
from tests.conftest import EVERY_STORE

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=EVERY_STORE)
def backend(request: pytest.FixtureRequest) -> str:
    """PostgreSQL, the embedded SQLite default, and the in-memory store."""
    return str(request.param)


def test_sleep_parks_the_run_and_resumes_without_redoing_earlier_steps(durable):
    calls = []
    wf = durable.workflow("reminder")

    @wf.step
    def prepare(user):
        calls.append("prepare")

    @wf.step
    def remind(user):
        calls.append("before sleep")
        current_run().sleep(0.6)
        calls.append("after sleep")
        return f"reminded {user}"

    with worker(durable):
        run_id = durable.start(wf, {"user": "ada"})
        parked = wait_for(durable, run_id, statuses=("waiting",))
        assert parked.status == "waiting"
        run = wait_for(durable, run_id)
    assert run.output == "reminded ada"
    # the step is re-run from the top: work before the sleep runs again, earlier steps do not
    assert calls == ["prepare", "before sleep", "before sleep", "after sleep"]
    remind_row = durable.list_steps(run_id)[1]
    assert (remind_row.finished_at - run.created_at).total_seconds() >= 0.6


def test_sleep_until_and_several_sleeps_in_one_step(durable):
    passes = []
    wf = durable.workflow("sleepy")

    @wf.step
    def nap():
        passes.append(current_run().attempt)
        current_run().sleep(0.2)
        current_run().sleep_until(datetime.now(timezone.utc) + timedelta(seconds=0.2))
        current_run().sleep(0)  # nothing to wait for
        return len(passes)

    with worker(durable):
        run = wait_for(durable, durable.start(wf))
    assert run.status == "completed" and run.output == 3  # parked twice, resumed twice
    with pytest.raises(InvalidArgument):
        from durable_celery.core.context import RunContext

        RunContext.sleep_until(None, datetime.now())  # type: ignore[arg-type]


def test_many_sleeping_runs_do_not_hold_worker_slots(durable):
    """200 runs asleep on a worker of two slots: other runs still start and finish."""
    wf = durable.workflow("napper")

    @wf.step
    def nap(n):
        current_run().sleep(3600)  # longer than the test: every sleeper is asleep throughout
        return n

    quick = durable.workflow("quick")

    @quick.step
    def hello(n):
        return n

    with worker(durable, concurrency=2):
        sleepers = [durable.start(wf, {"n": n}) for n in range(200)]
        for run_id in sleepers:
            assert wait_for(durable, run_id, statuses=("waiting",), timeout=60).status == "waiting"
        quick_ids = [durable.start(quick, {"n": n}) for n in range(5)]
        for run_id in quick_ids:
            assert wait_for(durable, run_id, timeout=30).output in range(5)
        asleep = durable.list_runs(workflow="napper", status="waiting", limit=500)
        assert len(asleep) == 200  # the quick runs finished while every sleeper slept
        assert all(durable.cancel(run_id) for run_id in sleepers)  # a sleeper can still be cancelled
    assert {durable.get_run(run_id).status for run_id in sleepers} == {"cancelled"}


def test_a_sleeping_run_survives_a_worker_restart(durable):
    wf = durable.workflow("patient")

    @wf.step
    def wait_a_bit():
        current_run().sleep(1.0)
        return "woke"

    with worker(durable):
        run_id = durable.start(wf)
        wait_for(durable, run_id, statuses=("waiting",))
    time.sleep(1.2)  # due while no worker runs
    assert durable.get_run(run_id).status == "waiting"
    with worker(durable):
        assert wait_for(durable, run_id).output == "woke"


def test_wait_for_input_and_provide_input(durable):
    wf = durable.workflow("approval")

    @wf.step
    def ask(amount):
        decision = current_run().wait_for_input("approved", timeout=30)
        return {"amount": amount, "approved": decision}

    with worker(durable):
        run_id = durable.start(wf, {"amount": 900}, key="refund:1")
        wait_for(durable, run_id, statuses=("waiting",))
        (pending,) = durable.list_pending_inputs()
        assert pending.run_id == run_id and pending.name == "approved"
        assert pending.workflow == "approval" and pending.key == "refund:1"
        assert durable.provide_input(run_id, "approved", True) is True
        run = wait_for(durable, run_id)
    assert run.output == {"amount": 900, "approved": True}
    assert durable.list_pending_inputs() == []
    assert durable.provide_input(run_id, "approved", False) is False  # finished
    with pytest.raises(InvalidArgument):
        durable.send_event(run_id, "durable:input:approved", True)  # reserved names


def test_input_given_before_the_run_waits_is_kept(durable):
    entered, release = threading.Event(), threading.Event()
    wf = durable.workflow("early")

    @wf.step
    def ask():
        entered.set()
        release.wait(10)
        return current_run().wait_for_input("answer")

    with worker(durable):
        run_id = durable.start(wf)
        assert entered.wait(10)
        durable.provide_input(run_id, "answer", 42)
        release.set()
        assert wait_for(durable, run_id).output == 42


def test_snooze_hands_the_run_back_without_using_an_attempt(durable):
    seen = []
    wf = durable.workflow("rate_limited")

    @wf.step(retry=1)
    def call_api():
        seen.append(current_run().attempt)
        if len(seen) == 1:
            current_run().snooze(0.3, "rate limited")
        return "called"

    with worker(durable):
        run = wait_for(durable, durable.start(wf))
    assert run.status == "completed" and run.output == "called"
    assert seen == [1, 1]  # the same attempt, twice
    (entry,) = durable.activity(kinds=["snoozed"])
    assert entry.details["reason"] == "rate limited" and entry.details["step"] == "call_api"
    assert [s.status for s in durable.list_steps(run.id)] == ["completed"]


def test_cancel_reaches_a_waiting_run_at_once(durable):
    resumed = []
    wf = durable.workflow("long_nap")

    @wf.step
    def nap():
        current_run().sleep(0.5)
        resumed.append(True)

    with worker(durable):
        run_id = durable.start(wf)
        wait_for(durable, run_id, statuses=("waiting",))
        assert durable.cancel(run_id) is True
        assert durable.get_run(run_id).status == "cancelled"
        time.sleep(1.0)  # past the sleep's end: a resumed step would have run by now
    assert resumed == []
    assert durable.get_run(run_id).status == "cancelled"
    assert durable.list_steps(run_id) == []


def test_send_event_reaches_a_waiting_run_and_only_buffered_events_are_kept(durable):
    wf = durable.workflow("approval")
    before_wait: list[int] = []

    @wf.step
    def approve(n):
        before_wait.append(n)
        first = current_run().wait_for_event("approved")
        second = current_run().wait_for_event("shipped")
        return [first, second]

    with worker(durable):
        run_id = durable.start(wf, {"n": 1})
        assert durable.send_event(run_id, "shipped", {"box": 1}) is False  # not waiting: dropped
        wait_for(durable, run_id, statuses=("waiting",))
        assert durable.send_event(run_id, "approved", {"by": "ann"}) is True
        # The second pass began (len first), then parked: the status is read after it began.
        _wait_until(lambda: len(before_wait) == 2 and durable.get_run(run_id).status == "waiting")
        # one event per name: a second "approved" is kept but never read
        assert durable.send_event(run_id, "approved", {"by": "bob"}, buffer=True) is True
        assert durable.send_event(run_id, "shipped", {"box": 2}) is True
        run = wait_for(durable, run_id)
    assert run.output == [{"by": "ann"}, {"box": 2}]
    assert durable.send_event(run_id, "approved", {}) is False  # finished


def test_a_wait_that_times_out_without_timeout_value_fails_the_step(durable):
    wf = durable.workflow("deadline")

    @wf.step
    def wait():
        current_run().wait_for_event("never", timeout=0.3)

    with worker(durable):
        run = wait_for(durable, durable.start(wf))
    assert run.status == "failed" and run.error["type"] == "EventTimeout"


def test_a_completed_wait_is_not_repeated_and_work_after_it_runs_once(durable):
    """The replay promise: an earlier step never runs again, a wait already come through
    returns its stored value at once, and what follows the last wait runs exactly once."""
    effects: list[str] = []
    wf = durable.workflow("signup_flow")

    @wf.step
    def create_account(email):
        effects.append("account")

    @wf.step
    def confirm(email):
        code = current_run().wait_for_input("code")
        effects.append(f"checked {code}")  # runs again on the next resume: idempotent reads only
        current_run().sleep(0.2)
        effects.append("welcome mail")
        return code

    with worker(durable):
        run_id = durable.start(wf, {"email": "a@b"})
        wait_for(durable, run_id, statuses=("waiting",))
        durable.provide_input(run_id, "code", "1234")
        run = wait_for(durable, run_id)
    assert run.output == "1234"
    assert effects.count("account") == 1 and effects.count("welcome mail") == 1
    assert effects == ["account", "checked 1234", "checked 1234", "welcome mail"]


def _wait_until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_events_sent_while_runs_park_are_never_lost(make_durable):
    # Upkeep's missed-wake-up repair is pushed out of reach: every run must be woken by its
    # event's own transaction, however the send and the park interleave.
    durable = make_durable(sweep_interval=3600.0, stale_lock_timeout=3600.0)
    wf = durable.workflow("racing_event")

    @wf.step
    def wait():
        return current_run().wait_for_event("go", timeout=60)

    with worker(durable, concurrency=4):
        run_ids = [durable.start(wf) for _ in range(40)]
        for run_id in run_ids:  # sent as each run reaches its wait, racing the park
            _wait_until(lambda run_id=run_id: durable.get_run(run_id).status in ("running", "waiting"))
            assert durable.send_event(run_id, "go", run_id, buffer=True) is True
        runs = [wait_for(durable, run_id, timeout=20) for run_id in run_ids]
    assert [r.output for r in runs] == run_ids


def test_upkeep_wakes_a_run_whose_event_is_kept_but_that_was_never_woken(make_durable):
    from durable_celery.store import event_rows

    durable = make_durable(sweep_interval=0.3)
    wf = durable.workflow("lost_wakeup")

    @wf.step
    def wait():
        return current_run().wait_for_event("go")

    with worker(durable):
        run_id = durable.start(wf)
        wait_for(durable, run_id, statuses=("waiting",))
        # The state a lost wake-up leaves: the event kept, the run still waiting and not due.
        with durable.db.begin() as conn:
            event_rows.insert_event_txn(durable.db, conn, run_id, "go", "late")
        run = wait_for(durable, run_id)
    assert run.status == "completed" and run.output == "late"


def test_a_run_failed_while_waiting_waits_afresh_when_retried(durable):
    wf = durable.workflow("approval_deadline", timeout=2.0)

    @wf.step
    def approve():
        return current_run().wait_for_input("approve")

    with worker(durable):
        run_id = durable.start(wf)
        run = wait_for(durable, run_id, timeout=20)
        assert run.status == "failed" and run.error["type"] == "WorkflowTimeout"
        assert durable.retry(run_id) == run_id
        wait_for(durable, run_id, statuses=("waiting",))  # waiting again, not timed out at once
        durable.provide_input(run_id, "approve", "yes")
        run = wait_for(durable, run_id)
    assert run.status == "completed" and run.output == "yes"


def test_a_sleep_woken_early_sleeps_on_until_its_end(durable):
    import time

    from sqlalchemy import update

    from durable_celery.store.schema import runs

    wf = durable.workflow("early_wake")
    passes = []

    @wf.step
    def nap():
        passes.append(time.monotonic())
        current_run().sleep(2.0)
        return "rested"

    with worker(durable):
        run_id = durable.start(wf)
        wait_for(durable, run_id, statuses=("waiting",))
        started = time.monotonic()
        # Made due early (as a stray hand-back of a rolling deploy can): the sleep is not over.
        with durable.db.begin() as conn:
            conn.execute(update(runs).where(runs.c.id == run_id).values(due_at=durable.db.now()))
        _wait_until(lambda: len(passes) == 2)
        assert durable.get_run(run_id).status in ("running", "waiting")
        run = wait_for(durable, run_id)
    assert run.status == "completed" and run.output == "rested"
    assert time.monotonic() - started >= 1.0  # it slept on; it did not end at the early wake
