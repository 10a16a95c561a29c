"""Rolling out code: a worker without a workflow hands its runs back; a renamed step fails the
run with definition_changed, and retry resumes it once the step is back."""

from __future__ import annotations

import pytest

from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(90)


def test_a_worker_without_the_code_hands_the_run_back_until_one_with_it_comes(make_durable):
    old = make_durable("old_build", missing_code_retry=0.5)  # has no "report" workflow
    new = make_durable("new_build", missing_code_retry=0.5)
    report = new.workflow("report")

    @report.step
    def build():
        return "built"

    with worker(old):
        run_id = new.start(report)  # the new build's producer starts it; only old workers run
        _until(lambda: old.activity(kinds=["code_missing"], run_id=run_id))
        assert old.get_run(run_id).status == "pending"
    with worker(new):
        run = wait_for(new, run_id)
    assert run.status == "completed" and run.output == "built"
    missing = new.activity(kinds=["code_missing"], run_id=run_id)
    assert missing and missing[-1].details["step"] == "build" and missing[-1].details["retry_in"] == 0.5


def test_a_renamed_step_fails_the_run_with_definition_changed_and_retry_resumes_it(make_durable):
    before = make_durable("before")
    flow_before = before.workflow("flow")
    gate = {"open": False}

    @flow_before.step
    def first():
        return 1

    @flow_before.step(retry=5, backoff=0.3)
    def charge():
        if not gate["open"]:
            raise ConnectionError("bank away")  # retried later: the run sits at "charge"
        return "charged"

    with worker(before):
        run_id = before.start(flow_before)
        _until(lambda: [s.name for s in before.list_steps(run_id)] == ["first", "charge"])

    after = make_durable("after")  # the new build renamed "charge"
    flow_after = after.workflow("flow")
    flow_after.step(lambda: 1, name="first")
    flow_after.step(lambda: "paid", name="take_payment")
    with worker(after):
        run = wait_for(after, run_id)
    assert run.status == "failed" and run.error["type"] == "definition_changed"
    assert "charge" in run.error["message"]

    gate["open"] = True  # the old step is back (the old build again)
    with worker(before):
        assert before.retry(run_id) == run_id
        run = wait_for(before, run_id)
    assert run.status == "completed" and run.output == "charged"


def _until(condition, seconds: float = 30.0):
    import time

    deadline = time.monotonic() + seconds
    while not (result := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return result
