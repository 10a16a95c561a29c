"""What a step's recorded outcome writes, sends and resets: the next message (a first attempt
under the run's key), the end (``run_finished`` names the workflow; ``losses`` cleared by every
transition), a retried run's whole retry budget, a failed attempt's traceback and message
result, a value or context JSON cannot hold, a snooze's activity entry, a completed holder kept
by reuse cancelling the run behind it, and the statements of a record on PostgreSQL.

Steps run through ``run_message``, as a worker runs a message, in the test's thread, on both
backends. Written against mutants of durable_celery/core/engine.py that the behaviour tests
let through; the last two, with real worker threads, guard issue 12."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import update

from durable_celery import current_run
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for, worker
from tests.integration.core.helpers import set_losses
from tests.integration.helpers import run_dict, run_row

pytestmark = pytest.mark.timeout(60)


def test_each_next_message_is_a_first_attempt_under_the_runs_key_and_the_end_names_the_workflow(
    durable, seen
):
    wf = durable.workflow("relayed")

    @wf.step(compensate=lambda: None)
    def first():
        return 1

    @wf.step(retry=2, backoff=30)
    def second():
        raise RuntimeError("declined")

    run_id = durable.start(wf, key="order:9")
    seen.clear()
    steps = [
        (0, False, "running", ("relayed", 1, run_id, 1, "order:9")),  # the next step
        (1, False, "retrying", None),  # a retry is the relay's to send when due
        (1, False, "compensating", ("relayed", 0, run_id, 1, "order:9")),  # the compensation
        (0, True, "compensated", None),
    ]
    for index, compensate, status, message in steps:
        set_losses(durable, run_id)  # a loss of the step in progress: gone once it is recorded
        seen.published.clear()
        assert durable.run_message("relayed", index, run_id, compensate=compensate) == status
        assert seen.published == ([message] if message else [])
        assert run_row(durable, run_id).losses == 0, status
    finished = [s for s in seen.signals if s[0] == "run_finished"]
    assert finished == [("run_finished", {"run_id": run_id, "workflow": "relayed", "status": "compensated"})]


@pytest.mark.parametrize("fail", [False, True])
def test_a_run_that_ends_has_no_losses_and_its_end_names_the_workflow(durable, seen, fail):
    wf = durable.workflow("single")

    @wf.step
    def only():
        if fail:
            raise RuntimeError("no")
        return "done"

    run_id = durable.start(wf)
    set_losses(durable, run_id)
    status = "failed" if fail else "completed"
    assert durable.run_message("single", 0, run_id) == status
    assert run_row(durable, run_id).losses == 0
    finished = [s for s in seen.signals if s[0] == "run_finished"]
    assert finished == [("run_finished", {"run_id": run_id, "workflow": "single", "status": status})]


def test_a_retried_run_gets_the_steps_whole_retry_budget_again(durable):
    wf = durable.workflow("budget")

    @wf.step(retry=2, backoff=30)
    def flaky():
        raise RuntimeError("down")

    run_id = durable.start(wf)
    statuses = []
    for _ in range(2):
        set_losses(durable, run_id)
        statuses.append(durable.run_message("budget", 0, run_id))
    assert statuses == ["retrying", "failed"]
    durable.retry(run_id)  # attempt 3, counted from 2: this attempt and one more
    for _ in range(2):
        set_losses(durable, run_id)
        statuses.append(durable.run_message("budget", 0, run_id))
    assert statuses == ["retrying", "failed", "retrying", "failed"]
    assert run_row(durable, run_id).attempt == 4


def test_a_failed_attempt_keeps_the_whole_traceback(durable):
    wf = durable.workflow("traced")

    @wf.step
    def declines():
        raise ValueError("declined")

    run_id = durable.start(wf)
    assert durable.run_message("traced", 0, run_id) == "failed"
    (step,) = durable.list_steps(run_id)
    error = step.error
    assert (error["type"], error["message"]) == ("ValueError", "declined")
    trace = error["traceback"]
    assert trace.startswith("Traceback (most recent call last):\n  File ")
    assert trace.endswith("ValueError: declined\n")
    assert 'raise ValueError("declined")' in trace and "in declines" in trace
    assert durable.get_run(run_id).error == error


def test_a_failed_attempts_message_result_has_its_exception_and_attempt(durable):
    wf = durable.workflow("failing_twice")

    @wf.step(retry=2, backoff=30)
    def only():
        raise RuntimeError(f"attempt {current_run().attempt}")

    run_id = durable.start(wf)
    results = []
    for _ in range(2):
        set_losses(durable, run_id)
        results.append(durable.engine.execute_with_result(wf, wf.steps[0], run_id, None, False))
    assert [(r.status, str(r.error), r.attempt) for r in results] == [
        ("retrying", "attempt 1", 1),
        ("failed", "attempt 2", 2),
    ]
    assert not durable.engine.heartbeater.active  # each attempt's heartbeat ended with it


@pytest.mark.parametrize(
    ("returned", "context"),
    [(object(), {}), (float("nan"), {}), (1, {"at": object()}), (1, {"ratio": float("inf")})],
    ids=["value", "nan-value", "context", "inf-context"],
)
def test_a_value_or_context_json_cannot_hold_fails_the_attempt(durable, returned, context):
    wf = durable.workflow("unstorable")

    @wf.step
    def makes():
        current_run().context.update(context)
        return returned

    run_id = durable.start(wf)
    assert durable.run_message("unstorable", 0, run_id) == "failed"
    (step,) = durable.list_steps(run_id)
    assert (step.status, step.output, step.error["type"]) == ("failed", None, "TypeError")
    assert step.error["message"].startswith("a step's return value and context must be JSON: ")


def test_a_snooze_is_an_activity_entry_of_the_run_its_workflow_and_key(durable):
    wf = durable.workflow("napper")

    @wf.step
    def nap():
        if len(durable.activity(kinds=["snoozed"], run_id=current_run().id)) < 1:
            current_run().snooze(0.05, reason="rate limit")
        return "awake"

    run_id = durable.start(wf, key="nap:1")
    assert durable.run_message("napper", 0, run_id) == "snoozed"
    (entry,) = durable.activity(kinds=["snoozed"], run_id=run_id)
    assert (entry.workflow, entry.key) == ("napper", "nap:1")
    details = entry.details
    assert (details["step"], details["seconds"], details["reason"]) == ("nap", 0.05, "rate limit")
    assert "logs" not in details  # no lines captured
    row = run_row(durable, run_id)
    assert (row.status, row.attempt, row.locked_by) == ("running", 1, None)
    time.sleep(0.1)
    assert durable.run_message("napper", 0, run_id) == "completed"


def test_a_completed_holder_kept_by_reuse_cancels_the_run_waiting_behind_it(durable):
    wf = durable.workflow("kept", reuse="after_failure", on_duplicate="run_again")
    wf.step(lambda: 1, name="first")
    wf.step(lambda: 2, name="second")
    holder = durable.start(wf, key="k")
    assert durable.run_message("kept", 0, holder) == "running"
    behind = durable.start(wf, key="k")  # behind a started holder: waits for its end
    assert durable.get_run(behind).status == "waiting"
    assert durable.run_message("kept", 1, holder) == "completed"
    assert durable.get_run(behind).status == "cancelled"  # a completed holder keeps the key
    assert durable.activity(kinds=["key_handed_off"]) == []


def _statements(durable: Any) -> list[str]:
    from sqlalchemy import event

    seen: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement.split(None, 1)[0].upper())

    event.listen(durable.db.engine, "before_cursor_execute", note)
    return seen


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_steps_record_is_one_statement_unless_its_end_settles_a_key_or_a_parent(durable):
    """On PostgreSQL: the claim, then one statement recording the step (and claiming nothing
    more); a keyed or child run's end is a transaction that also settles the key or the parent."""
    wf = durable.workflow("counted")
    wf.step(lambda: 1, name="first")
    wf.step(lambda: 2, name="second")
    warm = durable.start(wf)
    durable.run_message("counted", 0, warm)  # the pool's first connection is not counted
    plain, keyed, child = durable.start(wf), durable.start(wf, key="k"), durable.start(wf)
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == child).values(parent_id=warm, parent_ref="c1"))
    statements = _statements(durable)
    seen = {}
    for name, run_id in [("plain", plain), ("keyed", keyed), ("child", child)]:
        for index in (0, 1):
            statements.clear()
            durable.run_message("counted", index, run_id)
            seen[name, index] = list(statements)
    one = ["UPDATE", "WITH"]  # the claim; the record (the run's row, its step row) in one
    assert seen == {
        ("plain", 0): one,
        ("plain", 1): one,
        ("keyed", 0): one,
        ("keyed", 1): ["UPDATE", "SELECT", "WITH"],  # the key row first, then the record
        ("child", 0): one,
        ("child", 1): ["UPDATE", "WITH", "UPDATE"],  # the record, then the parent
    }
    assert {durable.get_run(r).status for r in (plain, keyed, child)} == {"completed"}


# -- losses reset when a run ends, with real workers --------------------------------------------


def lose_once(durable):
    """What a stale take-back leaves on the current run: one more loss during this step."""
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == current_run().id).values(losses=runs.c.losses + 1))


@pytest.mark.timeout(120)  # real worker threads
def test_a_run_that_completes_after_a_loss_has_no_losses(durable):
    """Guards issue 12: a run's ``losses`` (stale take-backs during one step) is reset when the run
    ends by its step's outcome: it completes."""
    wf = durable.workflow("lossy")

    @wf.step
    def first():
        lose_once(durable)

    @wf.step
    def last():
        lose_once(durable)  # the last step was once lost, then completed

    one = durable.workflow("lossy_one")

    @one.step
    def only():
        lose_once(durable)

    with worker(durable):
        ids = [durable.start(wf), durable.start(one)]
        for run_id in ids:
            assert wait_for(durable, run_id).status == "completed"
    assert [run_dict(durable, run_id)["losses"] for run_id in ids] == [0, 0]


@pytest.mark.timeout(120)  # real worker threads
def test_losses_are_reset_when_a_run_fails_or_ends_its_compensation(durable):
    """Guards issue 12: a run's ``losses`` (stale take-backs during one step) is reset when the run
    ends by its step's outcome: it fails, is compensated, or its compensation fails."""
    failing = durable.workflow("fails")

    @failing.step(retry=2)
    def flaky(n):
        lose_once(durable)
        raise RuntimeError("told to fail")

    undone = durable.workflow("undone")

    def refund(n):
        lose_once(durable)

    @undone.step(compensate=refund)
    def charge(n):
        pass

    @undone.step
    def ship(n):
        raise RuntimeError("warehouse on fire")

    stuck = durable.workflow("stuck")

    def cannot_undo(n):
        lose_once(durable)
        raise RuntimeError("cannot undo")

    @stuck.step(compensate=cannot_undo, compensate_retry=1)
    def reserve(n):
        pass

    @stuck.step
    def deliver(n):
        raise RuntimeError("no truck")

    with worker(durable):
        ids = [durable.start(wf, {"n": 1}) for wf in (failing, undone, stuck)]
        statuses = [wait_for(durable, run_id).status for run_id in ids]
    assert statuses == ["failed", "compensated", "compensation_failed"]
    assert [run_dict(durable, run_id)["losses"] for run_id in ids] == [0, 0, 0]
