"""A step a cold shutdown cancelled (a second Ctrl-C, SIGQUIT), as the worker whose pool process
was running it hands it back (``hand_back_lost``): the run is due again at once, no attempt used,
with a ``handed_back`` entry naming the step, the process and why; a process that held nothing of
the run, or whose run was taken meanwhile, changes nothing; the run keeps its concurrency slot
(due now, it comes before the run parked behind it). And ``hand_back_now``: a cold shutdown
with no grace period begun stops a running step at once and hands its run back.

A "cancelled pool process" is a lock written under that process's node name, as its claim wrote
it. Everything runs in the test's thread, on both backends. Written against mutants of
durable_celery/core/engine.py that only the end-to-end cold-shutdown tests reached."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from durable_celery.core import flow
from durable_celery.core.engine import process_node
from durable_celery.models import aware
from durable_celery.store import queries
from tests.integration.core.helpers import take_over_run
from tests.integration.helpers import run_row

pytestmark = pytest.mark.timeout(60)

GONE_PID = 4_000_001  # above any pid_max: no live process of this host has it
WHY = "w1@host cancelled the step (a cold shutdown, or its broker connection was lost)"


def _order_flow(durable: Any, **options: Any) -> Any:
    wf = durable.workflow("order", **options)

    @wf.step
    def reserve(tenant="t"):
        return "reserved"

    @wf.step
    def charge(tenant="t"):
        return "charged"

    return wf


def _claimed_by(durable: Any, run_id: str, index: int, pid: int = GONE_PID) -> Any:
    with durable.db.single() as conn:
        row = queries.claim_run(durable.db, conn, run_id, index, f"{process_node(pid)}:7", None)
    assert row is not None
    return run_row(durable, run_id)


def test_a_cancelled_step_is_handed_back_due_now_without_using_an_attempt(durable):
    wf = _order_flow(durable)
    run_id = durable.start(wf, key="order:1")
    assert durable.run_message("order", 0, run_id) == "running"
    claimed = _claimed_by(durable, run_id, 1)

    assert durable.engine.hand_back_lost(run_id, GONE_PID, WHY) == "handed_back"

    row = run_row(durable, run_id)
    assert (row.status, row.step_index, row.step_name, row.attempt) == ("running", 1, "charge", 1)
    assert row.fence == claimed.fence
    assert row.locked_by is None and row.heartbeat_at is None and row.published is False
    assert row.due_at is not None and aware(row.due_at) <= durable.db.utcnow()
    assert [s.name for s in durable.list_steps(run_id)] == ["reserve"]  # no attempt used
    (entry,) = durable.activity(kinds=["handed_back"], run_id=run_id)
    assert (entry.workflow, entry.key) == ("order", "order:1")
    shown = {name: entry.details[name] for name in ("step", "node", "reason")}
    assert shown == {"step": "charge", "node": process_node(GONE_PID), "reason": WHY}
    # The next worker to take its message runs the step, as its first attempt.
    assert durable.run_message("order", 1, run_id) == "completed"
    assert [(s.name, s.attempt) for s in durable.list_steps(run_id)] == [("reserve", 1), ("charge", 1)]


@pytest.mark.parametrize("case", ["not-claimed", "other-process", "finished"])
def test_a_cancelled_process_that_held_nothing_of_the_run_changes_nothing(durable, case):
    wf = _order_flow(durable)
    run_id = durable.start(wf)
    if case == "other-process":
        _claimed_by(durable, run_id, 0, pid=GONE_PID + 1)
    elif case == "finished":
        assert durable.run_message("order", 0, run_id) == "running"
        assert durable.run_message("order", 1, run_id) == "completed"
    before = run_row(durable, run_id)

    assert durable.engine.hand_back_lost(run_id, GONE_PID, WHY) == "dropped"

    assert run_row(durable, run_id) == before
    assert durable.activity(kinds=["handed_back"], run_id=run_id) == []


def test_a_cancelled_process_whose_run_was_taken_meanwhile_changes_nothing(durable, monkeypatch):
    """Found held by the process, then taken (the stale sweep, a node that saw the process
    gone) before the hand-back's write: the write finds another fence and records nothing."""
    wf = _order_flow(durable)
    run_id = durable.start(wf)
    _claimed_by(durable, run_id, 0)
    real = queries.run_held_by

    def taken_after_the_look(conn: Any, run: str, prefix: str) -> Any:
        row = real(conn, run, prefix)
        take_over_run(durable, run_id, "fenced")
        return row

    monkeypatch.setattr(queries, "run_held_by", taken_after_the_look)
    before = run_row(durable, run_id)

    assert durable.engine.hand_back_lost(run_id, GONE_PID, WHY) == "dropped"

    row = run_row(durable, run_id)
    assert row.fence == before.fence + 1  # the other path's take-over, nothing of ours
    assert (row.locked_by, row.due_at, row.published) == (before.locked_by, before.due_at, before.published)
    assert durable.activity(kinds=["handed_back"], run_id=run_id) == []


def _parked_behind_a_cancelled_step(durable: Any) -> tuple[Any, str, str]:
    """A limit-1 workflow: the first run claimed by a pool process, the second parked for it."""
    wf = _order_flow(durable, concurrency={"limit": 1, "key": "{tenant}"})
    first, second = durable.start(wf, {"tenant": "t"}), durable.start(wf, {"tenant": "t"})
    node = f"{process_node(GONE_PID)}:7"
    assert flow.claim(durable.runtime, wf, wf.steps[0], first, node, False) is not None
    assert durable.engine.execute(wf, wf.steps[0], second, False) == "dropped"
    assert run_row(durable, second).flow_wait == "slot"
    return wf, first, second


def test_a_cancelled_step_keeps_its_slot_for_its_own_run(durable):
    """Handed back due now, the run is counted before any parked run: the run parked behind it
    stays parked until the handed-back run's step ends."""
    wf, first, second = _parked_behind_a_cancelled_step(durable)

    assert durable.engine.hand_back_lost(first, GONE_PID, WHY) == "handed_back"
    flow.release(durable.runtime, wf, "t")  # any release meanwhile finds no slot free

    assert run_row(durable, second).flow_wait == "slot"
    assert durable.engine.execute(wf, wf.steps[0], second, False) == "dropped"  # still parked
    assert durable.run_message("order", 0, first) == "running"  # its own run takes the slot back
    assert run_row(durable, second).flow_wait == "slot"
    assert durable.run_message("order", 1, first) == "completed"
    assert run_row(durable, second).flow_wait is None  # woken when the step ended


def test_a_cancelled_step_of_a_workflow_this_build_lacks_is_handed_back(durable, make_durable):
    """The worker handing back may not define the run's workflow (a rolling deploy): the run is
    handed back all the same."""
    wf = _order_flow(durable)
    run_id = durable.start(wf)
    _claimed_by(durable, run_id, 0)
    elsewhere = make_durable()  # the same database, no workflows defined
    assert "order" not in elsewhere.runtime.registry.workflows

    assert elsewhere.engine.hand_back_lost(run_id, GONE_PID, WHY) == "handed_back"

    assert run_row(durable, run_id).locked_by is None
    (entry,) = durable.activity(kinds=["handed_back"], run_id=run_id)
    assert entry.details["step"] == "reserve"


def test_hand_back_now_stops_a_running_step_with_no_grace_period_begun(durable):
    """A cold shutdown that came before any warm one: the running step is stopped at the next
    heartbeat tick and its run handed back; the engine says it is shutting down."""
    wf = durable.workflow("long")
    entered = threading.Event()

    @wf.step
    def slow():
        entered.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # stopped only by the shutdown
            time.sleep(0.01)
        return "too late"

    run_id = durable.start(wf)
    result: dict[str, str] = {}
    runner = threading.Thread(target=lambda: result.update(status=durable.run_message("long", 0, run_id)))
    runner.start()
    try:
        assert entered.wait(10)
        assert not durable.engine.shutting_down()
        begun = time.monotonic()
        durable.engine.hand_back_now()
        assert durable.engine.shutting_down() and durable.engine.drain_over()
        runner.join(15)
        assert not runner.is_alive()
        assert time.monotonic() - begun < 10  # not the step's own 20 s
    finally:
        durable.engine.undrain()
    assert result == {"status": "handed_back"}
    row = run_row(durable, run_id)
    assert (row.status, row.attempt, row.locked_by) == ("running", 1, None)
    assert durable.list_steps(run_id) == []
