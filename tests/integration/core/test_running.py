"""Running workflows with a real Celery worker, on PostgreSQL + Redis and on the embedded default."""

from __future__ import annotations

import threading
import time

import pytest

from durable_celery import current_run, signals
from durable_celery.testing import wait_for, worker
from tests.conftest import EVERY_STORE

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=EVERY_STORE)
def backend(request: pytest.FixtureRequest) -> str:
    """PostgreSQL, the embedded SQLite default, and the in-memory store."""
    return str(request.param)


def test_three_steps_pass_context_and_record_each_step(durable):
    wf = durable.workflow("sync_account")

    @wf.step
    def fetch(account):
        current_run().context["rows"] = [account, account + 1]
        return "fetched"

    @wf.step(queue=None)
    def transform(account):
        run = current_run()
        run.context["total"] = sum(run.context["rows"])
        return run.context["total"]

    @wf.step
    def save(account):
        run = current_run()
        return {"account": account, "saved": run.context["total"], "workflow": run.workflow}

    run_id = durable.start("sync_account", {"account": 7})
    assert durable.get_run(run_id).status == "pending"
    with worker(durable):
        run = wait_for(durable, run_id)
    assert run.status == "completed"
    assert run.output == {"account": 7, "saved": 15, "workflow": "sync_account"}
    assert run.context == {"rows": [7, 8], "total": 15}
    assert run.started_at is not None and run.finished_at >= run.started_at >= run.created_at
    steps = durable.list_steps(run_id)
    assert [(s.name, s.attempt, s.status, s.output) for s in steps] == [
        ("fetch", 1, "completed", "fetched"),
        ("transform", 1, "completed", 15),
        ("save", 1, "completed", {"account": 7, "saved": 15, "workflow": "sync_account"}),
    ]
    assert all(s.input == {"account": 7} and s.finished_at >= s.started_at for s in steps)
    assert steps[0].finished_at <= steps[1].started_at


def test_run_goes_pending_running_completed(durable):
    seen = []
    release = threading.Event()
    wf = durable.workflow("observed")

    @wf.step
    def first():
        seen.append(durable.get_run(current_run().id).status)
        release.wait(10)

    @wf.step
    def second():
        return "done"

    run_id = durable.start(wf)
    assert durable.get_run(run_id).status == "pending"
    with worker(durable):
        while not seen:
            time.sleep(0.02)
        assert durable.get_run(run_id).status == "running"
        release.set()
        assert wait_for(durable, run_id).status == "completed"
    assert seen == ["running"]


def test_step_retries_with_backoff_then_succeeds(durable):
    attempts = []
    wf = durable.workflow("flaky")

    @wf.step(retry=3, backoff=0.2)
    def call_gateway():
        run = current_run()
        attempts.append((run.attempt, time.monotonic()))
        if run.attempt < 3:
            raise ConnectionError(f"gateway down (attempt {run.attempt})")
        return "paid"

    run_id = durable.start("flaky")
    with worker(durable):
        run = wait_for(durable, run_id)
    assert run.status == "completed" and run.output == "paid"
    assert [a for a, _ in attempts] == [1, 2, 3]
    # exponential backoff: 0.2 s then 0.4 s at least
    assert attempts[1][1] - attempts[0][1] >= 0.2
    assert attempts[2][1] - attempts[1][1] >= 0.4
    steps = durable.list_steps(run_id)
    assert [(s.attempt, s.status) for s in steps] == [(1, "failed"), (2, "failed"), (3, "completed")]
    assert steps[0].error["type"] == "ConnectionError"
    assert steps[0].error["message"] == "gateway down (attempt 1)"


def test_last_attempt_fails_the_run_with_type_message_and_traceback(durable):
    wf = durable.workflow("doomed")

    @wf.step(retry=2, backoff=0.1)
    def check_address(street):
        raise ValueError(f"no such street: {street}")

    @wf.step
    def never(**_):  # every step gets the whole input
        raise AssertionError("must not run")

    run_id = durable.start(wf, {"street": "Nowhere 1"})
    with worker(durable):
        run = wait_for(durable, run_id)
    assert run.status == "failed"
    assert run.error["type"] == "ValueError"
    assert run.error["message"] == "no such street: Nowhere 1"
    assert "check_address" in run.error["traceback"] and "Traceback" in run.error["traceback"]
    assert [s.name for s in durable.list_steps(run_id)] == ["check_address", "check_address"]


def test_worker_slot_is_free_during_backoff(durable):
    order = []
    wf = durable.workflow("slow_retry")

    @wf.step(retry=2, backoff=1.5)
    def fail_once():
        if current_run().attempt == 1:
            order.append("first attempt")
            raise RuntimeError("later")
        order.append("second attempt")

    quick = durable.workflow("quick")

    @quick.step
    def hello():
        order.append("quick ran")

    with worker(durable, concurrency=1):
        slow_id = durable.start(wf)
        while not order:
            time.sleep(0.02)
        quick_id = durable.start(quick)
        wait_for(durable, quick_id)
        wait_for(durable, slow_id)
    # the one worker slot served another run while the first waited out its backoff
    assert order == ["first attempt", "quick ran", "second attempt"]


def test_step_timeout_uses_an_attempt(durable):
    wf = durable.workflow("too_slow")

    @wf.step(timeout=0.5, retry=2, backoff=0.1)
    def crawl():
        if current_run().attempt == 1:
            for _ in range(200):
                time.sleep(0.05)
        return "fast enough"

    run_id = durable.start(wf)
    with worker(durable):
        run = wait_for(durable, run_id)
    assert run.status == "completed" and run.output == "fast enough"
    first = durable.list_steps(run_id)[0]
    assert first.status == "failed" and first.error["type"] == "StepTimeout"
    assert (first.finished_at - first.started_at).total_seconds() < 3


def test_cancel_pending_run_never_starts(durable):
    ran = []
    wf = durable.workflow("cancellable")

    @wf.step
    def work(n):
        ran.append(n)

    cancelled = durable.start(wf, {"n": 1})
    assert durable.cancel(cancelled) is True
    assert durable.cancel(cancelled) is False  # already finished
    with worker(durable):
        later = durable.start(wf, {"n": 2})
        wait_for(durable, later)  # the worker has drained the queue past the cancelled message
    run = durable.get_run(cancelled)
    assert run.status == "cancelled" and run.started_at is None
    assert ran == [2]
    assert durable.list_steps(cancelled) == []


def test_cancel_running_run_stops_step_at_heartbeat_and_no_later_step_runs(durable):
    progress = []
    wf = durable.workflow("long_job")

    @wf.step
    def crunch():
        for i in range(400):  # 20 s of work in small slices, no explicit heartbeat
            progress.append(i)
            time.sleep(0.05)
        progress.append("finished")

    @wf.step
    def publish():
        progress.append("published")

    run_id = durable.start(wf)
    with worker(durable):
        while len(progress) < 5:
            time.sleep(0.02)
        assert durable.cancel(run_id) is True
        cancelled_at = time.monotonic()
        while True:  # the step notices at its next timed heartbeat (0.3 s in tests)
            seen = len(progress)
            time.sleep(0.5)
            if len(progress) == seen:
                break
            assert time.monotonic() - cancelled_at < 5, "step still running after cancel"
    assert "finished" not in progress and "published" not in progress
    run = durable.get_run(run_id)
    assert run.status == "cancelled"
    assert durable.list_steps(run_id) == []


def test_explicit_heartbeat_raises_once_cancelled(durable):
    outcome = []
    wf = durable.workflow("polite")

    @wf.step
    def loop():
        try:
            while True:
                current_run().heartbeat()
                time.sleep(0.01)
        except BaseException as exc:
            outcome.append(type(exc).__name__)
            raise

    run_id = durable.start(wf)
    with worker(durable):
        while durable.get_run(run_id).status != "running":
            time.sleep(0.02)
        durable.cancel(run_id)
        while not outcome:
            time.sleep(0.02)
    assert outcome == ["StepCancelled"]


def test_duplicate_messages_run_the_step_once(durable):
    calls = []
    wf = durable.workflow("once")

    @wf.step
    def charge(amount):
        calls.append(amount)
        time.sleep(0.2)
        return amount

    run_id = durable.start(wf, {"amount": 5})
    for _ in range(3):  # the same step message, delivered again and again
        durable.outbox.send(wf, 0, run_id, 1, None)
    with worker(durable, concurrency=4):
        run = wait_for(durable, run_id)
        time.sleep(0.5)  # let the extra copies reach the worker and be dropped
    assert run.status == "completed"
    assert calls == [5]
    assert len(durable.list_steps(run_id)) == 1


def test_late_message_for_finished_run_is_dropped(durable):
    calls = []
    wf = durable.workflow("late")

    @wf.step
    def only():
        calls.append(1)

    run_id = durable.start(wf)
    with worker(durable):
        wait_for(durable, run_id)
        durable.outbox.send(wf, 0, run_id, 1, None)
        assert durable.run_message("late", 0, run_id) == "dropped"
    assert calls == [1]


def test_fenced_out_worker_cannot_record_its_result(make_durable):
    # Heartbeats far apart and a short stale timeout: the sweep hands the run to another
    # worker thread while the first is still inside the step.
    durable = make_durable(heartbeat_interval=60, stale_lock_timeout=0.5, sweep_interval=0.2)
    calls = []
    fenced = []

    def on_fenced(sender, run_id, **kw):
        fenced.append(run_id)

    signals.worker_fenced.connect(on_fenced, weak=False)
    wf = durable.workflow("contested")

    @wf.step
    def slow_then_fast():
        calls.append(threading.get_ident())
        if len(calls) == 1:
            time.sleep(2.5)  # the lock goes stale meanwhile
            return "first worker"
        return "second worker"

    try:
        run_id = durable.start(wf)
        with worker(durable, concurrency=2):
            run = wait_for(durable, run_id)
            while not fenced:
                time.sleep(0.05)
    finally:
        signals.worker_fenced.disconnect(on_fenced)
    assert len(calls) == 2
    assert run.status == "completed" and run.output == "second worker"
    steps = durable.list_steps(run_id)
    assert [(s.status, s.output) for s in steps] == [("completed", "second worker")]
    assert fenced == [run_id]
    assert durable.engine.fenced_count == 1
