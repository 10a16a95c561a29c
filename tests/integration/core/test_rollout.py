"""Rolling out code: a worker without a workflow hands its runs back; a renamed step fails the
run with definition_changed, and retry resumes it once the step is back."""

from __future__ import annotations

import uuid

import pytest

from durable_celery.testing import wait_for, worker
from durable_celery.worker.nodes import Node

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


@pytest.mark.parametrize("backend", ["postgres"])
def test_an_older_worker_hands_back_a_step_only_newer_workers_have(make_durable):
    # A rolling deploy added step "second": a run a new worker moved on reaches an old worker.
    old = make_durable("old_build", missing_code_retry=0.3)
    new = make_durable("new_build", missing_code_retry=0.3)
    old.workflow("deploy").step(lambda: "first", name="first")
    deploy = new.workflow("deploy")
    deploy.step(lambda: "first", name="first")
    deploy.step(lambda: "second", name="second")
    run_id = new.start(deploy)
    assert new.run_message("deploy", 0, run_id) == "running"  # step "first", on a new worker
    tag = uuid.uuid4().hex[:6]
    # A live new node, as the database sees one: its row with its steps, just seen. (Not an
    # in-process worker: leaving the old worker's block ends every in-process worker at once,
    # since Celery's stop flag is process-wide, and the old worker would then rightly find no
    # live node with the step.)
    elsewhere = Node(new.runtime, new.app)
    elsewhere.name = f"new-{tag}@test"
    elsewhere.register()
    assert any(n["name"] == elsewhere.name for n in new.list_nodes())
    with worker(old, hostname=f"old-{tag}@test"):
        _until(lambda: len(old.activity(kinds=["code_missing"], run_id=run_id)) >= 2)
        run = old.get_run(run_id)
        assert run.status == "running" and run.error is None  # handed back, not failed
    missing = old.activity(kinds=["code_missing"], run_id=run_id)
    assert {m.details["step"] for m in missing} == {"second"}
    with worker(new, queues=[new.app.conf.task_default_queue]):
        run = wait_for(new, run_id)
    assert run.status == "completed" and run.output == "second"
    assert [(s.name, s.attempt) for s in new.list_steps(run_id)] == [("first", 1), ("second", 1)]


def _until(condition, seconds: float = 30.0):
    import time

    deadline = time.monotonic() + seconds
    while not (result := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return result
