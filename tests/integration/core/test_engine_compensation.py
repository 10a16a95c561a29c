"""Compensation messages as the engine runs them: the compensation, not the step; back to
front, each sent on its queue; retried, then ``compensation_failed``; its value kept when JSON
can hold it, its lines kept when it snoozes; a compensation that waits fails its attempt; one
stopped by a takeover, or ending after one, records nothing; a compensated run hands its key to
the run waiting behind it. With real workers: tests/integration/core/test_compensation.py.

Steps run through ``run_message``, as a worker runs a message, in the test's thread, on both
backends. Written against mutants of durable_celery/core/engine.py that the behaviour tests
let through."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import update

from durable_celery import current_run
from durable_celery.store.schema import runs
from tests.integration.core.helpers import take_over_run, undo_flow
from tests.integration.helpers import delete_queue, run_row

pytestmark = pytest.mark.timeout(60)


def test_a_compensation_message_runs_the_compensation_not_the_step(durable):
    wf = durable.workflow("undo")
    calls: list[str] = []

    @wf.step(compensate=lambda: calls.append("undo first"))
    def first():
        calls.append("first")

    @wf.step
    def second():
        raise ValueError("declined")

    run_id = durable.start(wf)
    assert durable.run_message("undo", 0, run_id) == "running"
    assert durable.run_message("undo", 1, run_id) == "compensating"
    assert durable.run_message("undo", 0, run_id) == "dropped"  # a step message: not claimable now
    assert durable.run_message("undo", 0, run_id, compensate=True) == "compensated"
    assert calls == ["first", "undo first"]
    assert [(s.phase, s.name) for s in durable.list_steps(run_id)][-1] == ("compensate", "first")


def test_compensations_run_back_to_front_each_sent_on_its_queue(durable):
    wf = durable.workflow("undo_chain")
    done: list[str] = []
    a_queue = f"{durable.app.conf.task_default_queue}-a"  # the run's queue is its next step's
    wf.step(lambda: 1, name="a", queue=a_queue, compensate=lambda: done.append("undo a") or "a undone")
    wf.step(lambda: 2, name="b", compensate=lambda: done.append("undo b") or "b undone")

    @wf.step
    def c():
        raise ValueError("declined")

    try:
        run_id = durable.start(wf)
        for index in range(2):
            assert durable.run_message("undo_chain", index, run_id) == "running"
        assert durable.run_message("undo_chain", 2, run_id) == "compensating"
        assert run_row(durable, run_id).queue == durable.app.conf.task_default_queue  # b's

        assert durable.run_message("undo_chain", 1, run_id, compensate=True) == "compensating"
    finally:
        delete_queue(durable.app, a_queue)  # the messages this test's run_message stood in for
    row = run_row(durable, run_id)
    assert (row.status, row.step_index, row.step_name) == ("compensating", 0, "a")
    assert (row.attempt, row.losses) == (1, 0)
    assert row.queue == a_queue and row.published is True
    assert row.due_at is not None and row.locked_by is None

    assert durable.run_message("undo_chain", 0, run_id, compensate=True) == "compensated"
    row = run_row(durable, run_id)
    assert (row.status, row.losses, row.due_at, row.locked_by) == ("compensated", 0, None, None)
    assert done == ["undo b", "undo a"]
    undone = [s for s in durable.list_steps(run_id) if s.phase == "compensate"]
    assert [(s.name, s.output, s.worker) for s in undone] == [
        ("b", "b undone", durable.engine.node),
        ("a", "a undone", durable.engine.node),
    ]


def test_a_failing_compensation_is_retried_then_ends_the_run_compensation_failed(durable):
    wf = durable.workflow("undo_fails")

    def undo():
        raise RuntimeError("refund refused")

    wf.step(lambda: 1, name="first", compensate=undo, compensate_retry=2)

    @wf.step
    def second():
        raise ValueError("declined")

    run_id = durable.start(wf)
    assert durable.run_message("undo_fails", 0, run_id) == "running"
    assert durable.run_message("undo_fails", 1, run_id) == "compensating"
    _set_losses = update(runs).where(runs.c.id == run_id).values(losses=2)  # lost twice before
    with durable.db.begin() as conn:
        conn.execute(_set_losses)

    assert durable.run_message("undo_fails", 0, run_id, compensate=True) == "compensating"
    row = run_row(durable, run_id)
    assert (row.status, row.attempt, row.losses, row.published, row.locked_by) == (
        "compensating",
        2,
        0,
        False,
        None,
    )
    assert row.due_at is not None
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(due_at=durable.db.utcnow(), losses=2))

    assert durable.run_message("undo_fails", 0, run_id, compensate=True) == "compensation_failed"
    row = run_row(durable, run_id)
    assert (row.status, row.losses, row.due_at, row.locked_by) == ("compensation_failed", 0, None, None)
    assert row.finished_at is not None
    undone = [(s.attempt, s.status) for s in durable.list_steps(run_id) if s.phase == "compensate"]
    assert undone == [(1, "failed"), (2, "failed")]


@pytest.mark.parametrize(
    ("returned", "kept"),
    [({"refund": "r-1"}, {"refund": "r-1"}), (object(), None), (float("nan"), None), ([1.5], [1.5])],
    ids=["json", "not-json", "nan", "list"],
)
def test_a_compensations_value_is_kept_when_json_can_hold_it(durable, returned, kept):
    _, run_id = undo_flow(durable, lambda: returned)
    assert durable.run_message("undoing", 0, run_id, compensate=True) == "compensated"
    undone = durable.list_steps(run_id)[-1]
    assert (undone.phase, undone.status, undone.output) == ("compensate", "completed", kept)


def test_a_compensation_that_snoozes_keeps_its_lines_on_the_entry(durable):
    import logging

    log = logging.getLogger("tests.engine.undo")

    def undo():
        if not durable.activity(kinds=["snoozed"], run_id=current_run().id):
            log.warning("refund API busy")
            current_run().snooze(0.05, reason="busy")
        return "refunded"

    _, run_id = undo_flow(durable, undo)
    assert durable.run_message("undoing", 0, run_id, compensate=True) == "snoozed"
    (entry,) = durable.activity(kinds=["snoozed"], run_id=run_id)
    assert [r["body"] for r in entry.details["logs"]] == ["refund API busy"]
    assert entry.workflow == "undoing"
    time.sleep(0.1)
    assert durable.run_message("undoing", 0, run_id, compensate=True) == "compensated"


def test_a_compensation_that_waits_fails_its_attempt_saying_so(durable):
    def undo():
        current_run().sleep(5)

    wf = durable.workflow("undo_waits")
    wf.step(lambda: 1, name="first", compensate=undo, compensate_retry=1)

    @wf.step
    def second():
        raise ValueError("declined")

    run_id = durable.start(wf)
    assert durable.run_message("undo_waits", 0, run_id) == "running"
    assert durable.run_message("undo_waits", 1, run_id) == "compensating"
    assert durable.run_message("undo_waits", 0, run_id, compensate=True) == "compensation_failed"
    undone = [s for s in durable.list_steps(run_id) if s.phase == "compensate"]
    assert [(s.status, s.error["type"], s.error["message"]) for s in undone] == [
        ("failed", "DurableError", "a compensation cannot wait (sleep, events, input, children)")
    ]


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
def test_a_compensation_stopped_by_a_takeover_records_nothing(durable, how):
    def undo():
        take_over_run(durable, current_run().id, how)
        current_run().heartbeat()  # raises: the run is not this worker's any more

    _, run_id = undo_flow(durable, undo)
    assert durable.run_message("undoing", 0, run_id, compensate=True) == how
    assert [s.phase for s in durable.list_steps(run_id)] == ["step", "step"]
    fenced = durable.activity(kinds=["worker_fenced"], run_id=run_id)
    assert [e.details["step"] for e in fenced] == (["first"] if how == "fenced" else [])


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
def test_a_compensation_that_ends_after_a_takeover_records_nothing(durable, how):
    def undo():
        take_over_run(durable, current_run().id, how)  # without a heartbeat to notice it
        return "refunded"

    _, run_id = undo_flow(durable, undo)
    assert durable.run_message("undoing", 0, run_id, compensate=True) == how
    assert [s.phase for s in durable.list_steps(run_id)] == ["step", "step"]
    fenced = durable.activity(kinds=["worker_fenced"], run_id=run_id)
    assert [e.details["step"] for e in fenced] == (["first"] if how == "fenced" else [])


def test_a_compensated_run_hands_its_key_to_the_run_waiting_behind_it(durable):
    wf = durable.workflow("undo_keyed", on_duplicate="run_again")
    wf.step(lambda: 1, name="first", compensate=lambda: "undone")

    @wf.step
    def second():
        raise ValueError("declined")

    holder = durable.start(wf, key="order:7")
    assert durable.run_message("undo_keyed", 0, holder) == "running"
    behind = durable.start(wf, key="order:7")  # behind a started holder: waits for its end
    assert behind != holder and durable.get_run(behind).status == "waiting"
    assert durable.run_message("undo_keyed", 1, holder) == "compensating"
    assert durable.get_run(behind).status == "waiting"  # the holder has not ended yet

    assert durable.run_message("undo_keyed", 0, holder, compensate=True) == "compensated"
    assert durable.get_run(behind).status == "pending"
    (handed,) = durable.activity(kinds=["key_handed_off"], run_id=behind)
    assert (handed.details["from"], handed.details["from_status"]) == (holder, "compensated")


def test_a_limited_workflows_compensation_message_runs_its_compensation(durable):
    """A workflow with a concurrency limit claims through its limit (flow.py); a compensation
    message is still claimed as a compensation, whatever the limit."""
    wf = durable.workflow("undo_limited", concurrency={"limit": 1, "key": "{tenant}"})
    undone: list[str] = []
    wf.step(lambda tenant: 1, name="first", compensate=lambda tenant: undone.append(tenant))

    @wf.step
    def second(tenant):
        raise ValueError("declined")

    run_id = durable.start(wf, {"tenant": "t"})
    assert durable.run_message("undo_limited", 0, run_id) == "running"
    assert durable.run_message("undo_limited", 1, run_id) == "compensating"
    assert durable.run_message("undo_limited", 0, run_id, compensate=True) == "compensated"
    assert undone == ["t"]
