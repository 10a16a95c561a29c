"""Log capture: what a step logs carries its run's metadata and is saved on the step row."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from durable_celery import InvalidDefinition, current_run
from durable_celery.instrument.logs import bind
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(90)


class Keep(logging.Handler):
    """Every record a handler on the root logger gets."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def billing_log():
    log = logging.getLogger("tests.billing")
    log.setLevel(logging.DEBUG)
    yield log
    log.setLevel(logging.NOTSET)


def test_levels_and_metadata_filter_on_every_attempt_with_trace_fields(make_durable, billing_log):
    durable = make_durable(
        log_capture={"levels": ["INFO", "ERROR"], "metadata_filter": ["account_id", "request_id"]},
        tracer_provider=TracerProvider(),
    )
    wf = durable.workflow(
        "billing", log_metadata=lambda data: {"account_id": data["account"], "card": "4111-secret"}
    )

    @wf.step(retry=2)
    def charge(account):
        billing_log.debug("not captured: below the levels")
        billing_log.info("charging %s", account, extra={"request_id": "r-1", "password": "hunter2"})
        billing_log.warning("not captured: WARNING is not listed")
        if current_run().attempt == 1:
            billing_log.error("card declined")
            raise RuntimeError("declined")
        return "charged"

    seen = Keep()
    with worker(durable):
        logging.getLogger().addHandler(seen)  # after the worker set up logging
        try:
            run_id = durable.start(wf, {"account": 7})
            run = wait_for(durable, run_id)
        finally:
            logging.getLogger().removeHandler(seen)
    assert run.status == "completed"
    first, second = durable.list_steps(run_id)
    assert (first.status, second.status) == ("failed", "completed")
    assert [(r["severity_text"], r["severity_number"], r["body"]) for r in first.logs] == [
        ("INFO", 9, "charging 7"),
        ("ERROR", 17, "card declined"),
    ]
    assert [r["body"] for r in second.logs] == ["charging 7"]
    info = first.logs[0]
    assert info["logger"] == "tests.billing"
    assert info["metadata"] == {
        "workflow": "billing",
        "workflow_id": run_id,
        "step": "charge",
        "attempt": 1,
        "account_id": 7,
        "request_id": "r-1",
    }
    assert second.logs[0]["metadata"]["attempt"] == 2
    # One trace for the run, one span per attempt, both named on every line of the attempt.
    assert len(info["trace_id"]) == 32 and len(info["span_id"]) == 16
    assert first.logs[1]["span_id"] == info["span_id"]
    assert second.logs[0]["trace_id"] == info["trace_id"]
    assert second.logs[0]["span_id"] != info["span_id"]
    # Every record made inside the step carries the metadata, whichever handler formats it.
    mine = [r for r in seen.records if r.name == "tests.billing"]
    assert len(mine) == 7  # four lines in the first attempt, three in the second
    assert {(r.workflow, r.workflow_id, r.step) for r in mine} == {("billing", run_id, "charge")}  # type: ignore[attr-defined]
    assert sorted({r.attempt for r in mine}) == [1, 2]  # type: ignore[attr-defined]
    assert all(r.account_id == 7 for r in mine)  # type: ignore[attr-defined]


def test_default_keeps_warning_and_above_and_console_false_hides_them(make_durable, billing_log):
    durable = make_durable(log_capture={"console": False})
    wf = durable.workflow("quiet")

    @wf.step
    def work():
        billing_log.info("routine")
        billing_log.warning("slow upstream", extra={"step": "the caller's own"})  # never clashes
        try:
            raise ValueError("boom")
        except ValueError:
            billing_log.exception("handled")
        return 1

    seen = Keep()
    with worker(durable):
        logging.getLogger().addHandler(seen)
        try:
            run_id = durable.start(wf)
            assert wait_for(durable, run_id).status == "completed"
        finally:
            logging.getLogger().removeHandler(seen)
    (step,) = durable.list_steps(run_id)
    assert [(r["severity_text"], r["body"]) for r in step.logs] == [
        ("WARNING", "slow upstream"),
        ("ERROR", "handled"),
    ]
    assert "ValueError: boom" in step.logs[1]["exception"]
    assert step.logs[0]["trace_id"] is None or len(step.logs[0]["trace_id"]) == 32
    # The saved lines stay off the other handlers; the ones not saved still reach them.
    shown = [r for r in seen.records if r.name == "tests.billing"]
    assert [r.getMessage() for r in shown] == ["routine"]
    assert shown[0].step == "work" and shown[0].workflow_id == run_id  # type: ignore[attr-defined]
    assert step.logs[0]["metadata"]["step"] == "work"


def test_capture_off_and_threads_bound_to_the_step(make_durable, billing_log):
    import threading

    off = make_durable(log_capture=False)
    wf_off = off.workflow("silent")

    @wf_off.step
    def silent():
        billing_log.error("not saved")

    on = make_durable("bound")
    wf_on = on.workflow("threaded")

    @wf_on.step
    def threaded():
        thread = threading.Thread(target=bind(lambda: billing_log.warning("from a thread")))
        thread.start()
        thread.join()

    # One after the other: both apps share the test's queue, and each knows only its own steps.
    off_id = off.start(wf_off)
    with worker(off):
        wait_for(off, off_id)
    on_id = on.start(wf_on)
    with worker(on):
        wait_for(on, on_id)
    assert off.list_steps(off_id)[0].logs is None
    (step,) = on.list_steps(on_id)
    assert [r["body"] for r in step.logs] == ["from a thread"]
    assert step.logs[0]["metadata"]["workflow_id"] == on_id


def test_log_metadata_must_be_callable(make_durable):
    durable = make_durable()
    with pytest.raises(InvalidDefinition, match="log_metadata"):
        durable.workflow("bad", log_metadata={"account_id": 1})


def test_lines_of_a_pass_that_snoozed_are_kept_on_its_activity_entry(durable, billing_log):
    wf = durable.workflow("quota")

    @wf.step
    def call_api():
        if durable.activity(kinds=["snoozed"], run_id=current_run().id):
            billing_log.warning("quota back")
            return "called"
        billing_log.warning("quota exceeded for %s", current_run().id)
        current_run().snooze(0.2, "quota")

    with worker(durable):
        run_id = durable.start(wf)
        assert wait_for(durable, run_id).status == "completed"
    (snoozed,) = durable.activity(kinds=["snoozed"], run_id=run_id)
    assert snoozed.details["reason"] == "quota"
    assert [(r["severity_text"], r["body"]) for r in snoozed.details["logs"]] == [
        ("WARNING", f"quota exceeded for {run_id}")
    ]
    assert snoozed.details["logs"][0]["metadata"]["workflow_id"] == run_id
    (step,) = durable.list_steps(run_id)
    assert [r["body"] for r in step.logs] == ["quota back"]
