"""Engine paths the behaviour tests reach only through other processes or other builds, in this
thread on both backends (mutants of durable_celery/engine.py that nothing ran):

- a step renamed in a new build, met by the engine (the message names the new step at the
  run's index): ``definition_changed``, or a hand-back when a live node has the old step;
- a pool process that died mid-step, as the worker that forked it records it (``record_lost``);
- a graceful shutdown whose grace period ends while a step runs: the run is handed back.

Steps run through ``run_message``, as a worker runs a message; a "dead pool process" is a lock
written under that process's node name, as its claim wrote it."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from sqlalchemy import select, update

from durable_celery import current_run, signals
from durable_celery.engine import process_node
from durable_celery.models import aware
from durable_celery.nodes import Node
from durable_celery.store import queries
from durable_celery.store.child_rows import CHILDREN_WAIT
from durable_celery.store.schema import runs

pytestmark = pytest.mark.timeout(60)

DEAD_PID = 4_000_000  # above any pid_max: no live process of this host has it


def _row(durable: Any, run_id: str) -> Any:
    with durable.db.engine.connect() as conn:
        return conn.execute(select(runs).where(runs.c.id == run_id)).one()


def _finished(durable: Any) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []

    def note(sender: Any, run_id: str, status: str, **_: Any) -> None:
        if sender is durable:
            seen.append((run_id, status))

    signals.run_finished.connect(note, weak=False)
    return seen


# -- a step renamed between builds ------------------------------------------------------------


def _builds(make_durable: Any, **settings: Any) -> tuple[Any, Any, dict[str, int]]:
    """The old build (first, charge) and the new (first, take_payment), on one store."""
    calls = {"charge": 0, "take_payment": 0, "undo": 0}
    old = make_durable("old_build", **settings)
    flow = old.workflow("flow")

    @flow.step(compensate=lambda: calls.__setitem__("undo", calls["undo"] + 1))
    def first():
        return 1

    @flow.step
    def charge():
        calls["charge"] += 1
        return "charged"

    new = make_durable("new_build", **settings)
    renamed = new.workflow("flow")
    renamed.step(lambda: 1, name="first")

    @renamed.step
    def take_payment():
        calls["take_payment"] += 1
        return "paid"

    return old, new, calls


def _at_second_step(old: Any) -> str:
    run_id = old.start("flow")
    assert old.run_message("flow", 0, run_id) == "running"
    row = _row(old, run_id)
    assert (row.step_index, row.step_name, row.status) == (1, "charge", "running")
    return run_id


def test_a_step_renamed_in_the_new_build_fails_the_run_with_definition_changed(make_durable):
    old, new, calls = _builds(make_durable)
    run_id = _at_second_step(old)
    finished = _finished(new)
    before = _row(old, run_id)

    assert new.run_message("flow", 1, run_id) == "definition_changed"

    assert calls == {"charge": 0, "take_payment": 0, "undo": 0}  # no step ran, nothing undone
    run = new.get_run(run_id)
    assert run.status == "failed" and run.finished_at is not None
    assert run.error["type"] == "definition_changed"
    assert run.error["message"] == "workflow 'flow' has no step 'charge' any more; retry once it is back"
    row = _row(new, run_id)
    assert row.due_at is None and row.locked_by is None and row.losses == 0
    assert row.fence == before.fence + 1  # the claim's, and nothing after
    assert finished == [(run_id, "failed")]
    steps = new.list_steps(run_id)
    assert [(s.step_index, s.name, s.attempt, s.status) for s in steps] == [
        (0, "first", 1, "completed"),
        (1, "charge", 1, "failed"),
    ]
    recorded = steps[-1]
    assert recorded.error == run.error
    assert recorded.worker == new.engine.node
    assert recorded.started_at <= recorded.finished_at

    assert old.retry(run_id) == run_id  # the old step is back: retry resumes it there
    assert old.run_message("flow", 1, run_id) == "completed"
    assert old.get_run(run_id).output == "charged" and calls["charge"] == 1


def test_a_step_a_live_node_still_has_is_handed_back_to_it_without_an_attempt(make_durable):
    old, new, calls = _builds(make_durable, missing_code_retry=0.05)
    run_id = _at_second_step(old)
    elsewhere = Node(old)  # a live node of the old build, as the database sees one
    elsewhere.name = f"old-{run_id[:8]}@test"
    elsewhere.register()
    before = _row(old, run_id)

    assert new.run_message("flow", 1, run_id) == "deferred"

    row = _row(new, run_id)
    assert (row.status, row.step_index, row.step_name) == ("running", 1, "charge")
    assert row.locked_by is None and row.heartbeat_at is None and row.published is False
    assert row.due_at is not None and row.attempt == before.attempt == 1 and row.error is None
    assert [s.name for s in new.list_steps(run_id)] == ["first"]  # no attempt recorded
    missing = new.activity(kinds=["code_missing"], run_id=run_id)
    assert [(m.details["step"], m.details["retry_in"]) for m in missing] == [("charge", 0.05)]
    assert calls["take_payment"] == 0

    time.sleep(0.1)  # due again after missing_code_retry
    assert old.run_message("flow", 1, run_id) == "completed"
    assert old.get_run(run_id).output == "charged"


def test_a_renamed_step_whose_hand_back_finds_the_run_gone_is_dropped(make_durable):
    old, new, _ = _builds(make_durable, missing_code_retry=0.05)
    run_id = _at_second_step(old)
    elsewhere = Node(old)
    elsewhere.name = f"old-{run_id[:8]}@test"
    elsewhere.register()
    original = queries.hand_back_txn

    def cancelled_first(db: Any, conn: Any, rid: str, fence: int, seconds: float) -> bool:
        conn.execute(update(runs).where(runs.c.id == rid).values(fence=runs.c.fence + 1))
        return original(db, conn, rid, fence, seconds)

    queries.hand_back_txn = cancelled_first
    try:
        assert new.run_message("flow", 1, run_id) == "dropped"
    finally:
        queries.hand_back_txn = original
    assert new.activity(kinds=["code_missing"], run_id=run_id) == []


# -- a pool process that died mid-step -----------------------------------------------------------


def _lost_flow(durable: Any, retry: int = 1) -> Any:
    wf = durable.workflow("lossy")

    @wf.step(compensate=lambda: "undone")
    def first():
        return 1

    @wf.step(retry=retry)
    def second():
        return 2

    @wf.step
    def third():
        return 3

    return wf


def _claimed_by_dead_process(durable: Any, run_id: str, index: int, compensate: bool = False) -> Any:
    with durable.db.single() as conn:
        row = queries.claim_run(
            durable.db, conn, run_id, index, f"{process_node(DEAD_PID)}:7", None, compensate=compensate
        )
    assert row is not None
    return _row(durable, run_id)


def test_a_lost_process_uses_the_attempt_and_the_run_backs_off(durable):
    wf = _lost_flow(durable, retry=2)
    run_id = durable.start(wf)
    assert durable.run_message("lossy", 0, run_id) == "running"
    claimed = _claimed_by_dead_process(durable, run_id, 1)

    assert durable.engine.record_lost(wf, wf.steps[1], run_id, DEAD_PID, "signal 9 (SIGKILL)") == "retrying"

    row = _row(durable, run_id)
    assert (row.status, row.step_index, row.attempt) == ("running", 1, 2)
    assert row.locked_by is None and row.due_at is not None
    lost = durable.list_steps(run_id)[-1]
    assert (lost.name, lost.attempt, lost.status) == ("second", 1, "failed")
    assert lost.worker == process_node(DEAD_PID)
    assert lost.error["type"] == "WorkerLost"
    assert lost.error["message"] == "the process running step 'second' died: signal 9 (SIGKILL)"
    assert lost.started_at == aware(claimed.heartbeat_at)  # the claim's time is its last beat


def test_a_lost_process_on_the_last_attempt_fails_the_run_after_compensating(durable):
    wf = _lost_flow(durable, retry=1)
    run_id = durable.start(wf)
    assert durable.run_message("lossy", 0, run_id) == "running"
    _claimed_by_dead_process(durable, run_id, 1)

    assert durable.engine.record_lost(wf, wf.steps[1], run_id, DEAD_PID, "exit 1") == "compensating"
    assert durable.get_run(run_id).error["type"] == "WorkerLost"


def test_a_lost_process_that_went_on_inline_loses_the_step_it_was_running(durable):
    wf = _lost_flow(durable, retry=2)
    run_id = durable.start(wf)
    assert durable.run_message("lossy", 0, run_id) == "running"
    _claimed_by_dead_process(durable, run_id, 1)

    # The message was for step 0; the process had gone on to step 1 (inline continuation).
    assert durable.engine.record_lost(wf, wf.steps[0], run_id, DEAD_PID, "exit 1") == "retrying"
    assert [(s.name, s.status) for s in durable.list_steps(run_id)] == [
        ("first", "completed"),
        ("second", "failed"),
    ]


def test_a_lost_compensation_is_recorded_as_a_compensation(durable):
    wf = _lost_flow(durable, retry=1)
    run_id = durable.start(wf)
    with durable.db.begin() as conn:  # a run compensating step 0 ("first")
        conn.execute(
            update(runs)
            .where(runs.c.id == run_id)
            .values(status="compensating", step_index=0, step_name="first", due_at=durable.db.utcnow())
        )
    _claimed_by_dead_process(durable, run_id, 0, compensate=True)

    status = durable.engine.record_lost(wf, wf.steps[0], run_id, DEAD_PID, "exit 1", compensate=True)

    assert status == "compensating"  # its compensation is tried again (compensate_retry 3)
    assert _row(durable, run_id).attempt == 2
    lost = durable.list_steps(run_id)[-1]
    assert (lost.phase, lost.name, lost.status) == ("compensate", "first", "failed")
    assert lost.error["type"] == "WorkerLost"


@pytest.mark.parametrize("case", ["no-lock", "other-process", "compensation-moved", "finished-step-index"])
def test_a_lost_process_that_held_nothing_of_the_step_changes_nothing(durable, case):
    wf = _lost_flow(durable, retry=2)
    run_id = durable.start(wf)
    assert durable.run_message("lossy", 0, run_id) == "running"
    compensate = False
    step = wf.steps[1]
    if case == "other-process":
        with durable.db.single() as conn:
            queries.claim_run(durable.db, conn, run_id, 1, f"{process_node(os.getpid())}:7", None)
    elif case == "compensation-moved":  # a compensation message; the process had moved on
        with durable.db.begin() as conn:
            conn.execute(
                update(runs)
                .where(runs.c.id == run_id)
                .values(status="compensating", step_index=0, due_at=durable.db.utcnow())
            )
        _claimed_by_dead_process(durable, run_id, 0, compensate=True)
        compensate, step = True, wf.steps[1]
    elif case == "finished-step-index":  # a lock at an index past the workflow's end
        _claimed_by_dead_process(durable, run_id, 1)
        with durable.db.begin() as conn:
            conn.execute(update(runs).where(runs.c.id == run_id).values(step_index=3))
        step = wf.steps[0]
    before = _row(durable, run_id)
    steps_before = durable.list_steps(run_id)

    status = durable.engine.record_lost(wf, step, run_id, DEAD_PID, "exit 1", compensate=compensate)
    assert status == "dropped"

    assert _row(durable, run_id) == before
    assert durable.list_steps(run_id) == steps_before


def test_a_lost_process_of_a_waiting_run_moved_on_is_dropped(durable):
    wf = _lost_flow(durable, retry=2)
    run_id = durable.start(wf)
    assert durable.run_message("lossy", 0, run_id) == "running"
    _claimed_by_dead_process(durable, run_id, 1)
    with durable.db.begin() as conn:  # the lock a compensating run keeps, at another index
        conn.execute(update(runs).where(runs.c.id == run_id).values(status="compensating"))
    before = _row(durable, run_id)

    assert durable.engine.record_lost(wf, wf.steps[0], run_id, DEAD_PID, "exit 1") == "dropped"
    assert _row(durable, run_id) == before


# -- a graceful shutdown -------------------------------------------------------------------------


def test_a_step_still_running_when_the_grace_period_ends_is_handed_back(durable):
    wf = durable.workflow("long")
    entered, seen = threading.Event(), {}

    @wf.step
    def slow():
        seen["shutting_down_at_start"] = current_run().shutting_down()
        entered.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # a long step, stopped only by the shutdown
            seen["shutting_down"] = current_run().shutting_down()
            time.sleep(0.01)
        return "too late"

    run_id = durable.start(wf)
    result: dict[str, str] = {}
    runner = threading.Thread(target=lambda: result.update(status=durable.run_message("long", 0, run_id)))
    try:
        runner.start()
        assert entered.wait(10)
        engine = durable.engine
        assert not engine.shutting_down() and not engine.drain_over()
        engine.drain(0.4)
        first_deadline = engine._drain_at.value
        engine.drain(30)  # a second signal keeps the first grace period
        assert engine._drain_at.value == first_deadline
        assert engine.shutting_down()
        runner.join(15)
        assert not runner.is_alive()
        assert engine.drain_over()
    finally:
        durable.engine.undrain()
    assert not durable.engine.shutting_down() and not durable.engine.drain_over()

    assert result == {"status": "handed_back"}
    assert seen == {"shutting_down_at_start": False, "shutting_down": True}
    row = _row(durable, run_id)
    assert (row.status, row.attempt, row.step_index) == ("running", 1, 0)
    assert row.locked_by is None and row.heartbeat_at is None and row.published is False
    assert row.due_at is not None and aware(row.due_at) <= durable.db.utcnow()
    assert durable.list_steps(run_id) == []  # no attempt used
    back = durable.activity(kinds=["handed_back"], run_id=run_id)
    assert [(b.details["step"], b.details["node"]) for b in back] == [("slow", durable.engine.node)]


# -- compensation and snooze messages -------------------------------------------------------------


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
    row = _row(durable, run_id)
    assert (row.status, row.attempt, row.locked_by) == ("running", 1, None)
    time.sleep(0.1)
    assert durable.run_message("napper", 0, run_id) == "completed"


# -- what a step's end meets: a takeover, a cancel, a key, a parent --------------------------------


def _take_over(durable: Any, run_id: str, how: str) -> None:
    """Another worker took the run (its fence moved on), or it was cancelled meanwhile."""
    values = {"fence": runs.c.fence + 1} if how == "fenced" else {"status": "cancelled"}
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(**values))


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
def test_a_renamed_step_whose_run_was_taken_meanwhile_records_nothing(make_durable, how):
    old, new, _ = _builds(make_durable)
    run_id = _at_second_step(old)
    fenced: list[str] = []

    def taken_now(sender: Any, run_id: str, **_: Any) -> None:
        if sender is new:
            _take_over(new, run_id, how)

    def note_fenced(sender: Any, run_id: str, step: str, **_: Any) -> None:
        if sender is new:
            fenced.append(step)

    signals.step_started.connect(taken_now, weak=False)
    signals.worker_fenced.connect(note_fenced, weak=False)
    try:
        assert new.run_message("flow", 1, run_id) == how
    finally:
        signals.step_started.disconnect(taken_now)
        signals.worker_fenced.disconnect(note_fenced)
    assert [s.name for s in new.list_steps(run_id)] == ["first"]
    entries = new.activity(kinds=["worker_fenced"], run_id=run_id)
    if how == "fenced":
        assert new.engine.fenced_count == 1 and fenced == ["take_payment"]
        assert [(e.details["step"], e.details["node"], e.details["attempt"]) for e in entries] == [
            ("take_payment", new.engine.node, 1)
        ]
        assert (entries[0].workflow, entries[0].key) == ("flow", None)
    else:
        assert new.engine.fenced_count == 0 and fenced == [] and entries == []


def test_a_renamed_step_frees_its_key_for_the_run_waiting_behind_it(make_durable):
    old, new, _ = _builds(make_durable)
    for durable in (old, new):
        durable.workflows["flow"].on_duplicate = "run_again"
    run_id = old.start("flow", key="order:1")
    assert old.run_message("flow", 0, run_id) == "running"
    again = old.start("flow", key="order:1")  # waits behind the holder
    assert again != run_id and old.get_run(again).status == "waiting"

    assert new.run_message("flow", 1, run_id) == "definition_changed"

    assert new.get_run(again).status == "pending"  # the key's next holder, due now
    assert new.run_message("flow", 0, again) == "running"


def test_the_code_missing_entry_names_the_workflow(make_durable):
    old, new, _ = _builds(make_durable, missing_code_retry=0.05)
    run_id = _at_second_step(old)
    elsewhere = Node(old)
    elsewhere.name = f"old-{run_id[:8]}@test"
    elsewhere.register()
    assert new.run_message("flow", 1, run_id) == "deferred"
    (entry,) = new.activity(kinds=["code_missing"], run_id=run_id)
    assert entry.workflow == "flow"


def test_a_lost_process_keeps_the_runs_context_and_names_the_dead_process(durable):
    wf = durable.workflow("ctx")

    @wf.step(compensate=lambda: None)
    def first():
        current_run().context["charged"] = 10
        return 1

    @wf.step(retry=1)
    def second():
        return 2

    run_id = durable.start(wf)
    assert durable.run_message("ctx", 0, run_id) == "running"
    _claimed_by_dead_process(durable, run_id, 1)
    assert durable.engine.record_lost(wf, wf.steps[1], run_id, DEAD_PID, "exit 1") == "compensating"
    assert _row(durable, run_id).context == {"charged": 10}

    _claimed_by_dead_process(durable, run_id, 0, compensate=True)
    assert durable.engine.record_lost(wf, wf.steps[0], run_id, DEAD_PID, "exit 1", compensate=True) == (
        "compensating"
    )
    lost = durable.list_steps(run_id)[-1]
    assert (lost.phase, lost.worker) == ("compensate", process_node(DEAD_PID))


def _slow_step(durable: Any, name: str, log: Any = None) -> tuple[Any, threading.Event]:
    wf = durable.workflow(name)
    entered = threading.Event()

    @wf.step
    def slow():
        if log is not None:
            log.warning("still busy with %s", current_run().id)
        entered.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return "too late"

    return wf, entered


def _drained(durable: Any, run_id: str, name: str, entered: threading.Event, before: Any = None) -> str:
    result: dict[str, str] = {}
    runner = threading.Thread(target=lambda: result.update(status=durable.run_message(name, 0, run_id)))
    runner.start()
    try:
        assert entered.wait(10)
        if before is not None:
            before()
        durable.engine.drain(0.05)
        runner.join(15)
        assert not runner.is_alive()
    finally:
        durable.engine.undrain()
    return result["status"]


def test_a_handed_back_entry_names_the_key_and_keeps_the_lines_logged(make_durable):
    import logging

    durable = make_durable()
    log = logging.getLogger("tests.engine.shutdown")
    wf, entered = _slow_step(durable, "keyed_long", log)
    run_id = durable.start(wf, key="long:1")
    assert _drained(durable, run_id, "keyed_long", entered) == "handed_back"
    (entry,) = durable.activity(kinds=["handed_back"], run_id=run_id)
    assert (entry.workflow, entry.key) == ("keyed_long", "long:1")
    assert [r["body"] for r in entry.details["logs"]] == [f"still busy with {run_id}"]


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
def test_a_hand_back_that_finds_the_run_taken_records_nothing(make_durable, how):
    durable = make_durable(heartbeat_interval=30.0)  # no beat notices first: the hand-back does
    wf, entered = _slow_step(durable, "taken_long")
    run_id = durable.start(wf)
    status = _drained(durable, run_id, "taken_long", entered, lambda: _take_over(durable, run_id, how))
    assert status == how
    assert durable.activity(kinds=["handed_back"], run_id=run_id) == []
    fenced = durable.activity(kinds=["worker_fenced"], run_id=run_id)
    assert [e.details["step"] for e in fenced] == (["slow"] if how == "fenced" else [])


# -- compensations and snoozes that meet a takeover ------------------------------------------------


def _undo_flow(durable: Any, undo: Any) -> tuple[Any, str]:
    """A run compensating its first step with ``undo`` (the second step failed)."""
    wf = durable.workflow("undoing")
    wf.step(lambda: 1, name="first", compensate=undo)

    @wf.step
    def second():
        raise ValueError("declined")

    run_id = durable.start(wf)
    assert durable.run_message("undoing", 0, run_id) == "running"
    assert durable.run_message("undoing", 1, run_id) == "compensating"
    return wf, run_id


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
def test_a_compensation_stopped_by_a_takeover_records_nothing(durable, how):
    def undo():
        _take_over(durable, current_run().id, how)
        current_run().heartbeat()  # raises: the run is not this worker's any more

    _, run_id = _undo_flow(durable, undo)
    assert durable.run_message("undoing", 0, run_id, compensate=True) == how
    assert [s.phase for s in durable.list_steps(run_id)] == ["step", "step"]
    fenced = durable.activity(kinds=["worker_fenced"], run_id=run_id)
    assert [e.details["step"] for e in fenced] == (["first"] if how == "fenced" else [])


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
@pytest.mark.parametrize("phase", ["step", "compensation"])
def test_a_snooze_of_a_run_taken_meanwhile_is_not_handed_back(durable, how, phase):
    def nap():
        _take_over(durable, current_run().id, how)
        current_run().snooze(5, reason="later")

    if phase == "step":
        wf = durable.workflow("napping")
        wf.step(nap, name="nap")
        run_id = durable.start(wf)
        status = durable.run_message("napping", 0, run_id)
    else:
        _, run_id = _undo_flow(durable, nap)
        status = durable.run_message("undoing", 0, run_id, compensate=True)
    assert status == how
    assert durable.activity(kinds=["snoozed"], run_id=run_id) == []
    row = _row(durable, run_id)
    held = "running" if phase == "step" else "compensating"
    assert row.status == ("cancelled" if how == "cancelled" else held)
    assert row.locked_by is not None  # not handed back: left as the takeover left it


@pytest.mark.parametrize(
    ("returned", "kept"),
    [({"refund": "r-1"}, {"refund": "r-1"}), (object(), None), (float("nan"), None), ([1.5], [1.5])],
    ids=["json", "not-json", "nan", "list"],
)
def test_a_compensations_value_is_kept_when_json_can_hold_it(durable, returned, kept):
    _, run_id = _undo_flow(durable, lambda: returned)
    assert durable.run_message("undoing", 0, run_id, compensate=True) == "compensated"
    undone = durable.list_steps(run_id)[-1]
    assert (undone.phase, undone.status, undone.output) == ("compensate", "completed", kept)


# -- a write whose answer an outage lost ------------------------------------------------------------


def _answer_lost_once(monkeypatch: Any, durable: Any, commit: bool) -> list[int]:
    """The engine's next write fails with an outage once: after committing (its answer lost on
    the way back) or before."""
    from durable_celery import DatabaseUnavailable

    real = type(durable.engine)._write_once
    failed: list[int] = []

    def write_once(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(1)
            if commit:
                real(engine, *args, **kwargs)
            raise DatabaseUnavailable("postgresql://db", "connection lost")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(type(durable.engine), "_write_once", write_once)
    return failed


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "not-committed"])
def test_a_write_an_outage_interrupted_is_recorded_once(durable, monkeypatch, commit):
    wf = durable.workflow("outage")
    wf.step(lambda: 1, name="first")
    wf.step(lambda: 2, name="second")
    run_id = durable.start(wf)
    failed = _answer_lost_once(monkeypatch, durable, commit)

    assert durable.run_message("outage", 0, run_id) == "running"

    assert failed == [1]
    steps = durable.list_steps(run_id)
    assert [(s.name, s.attempt, s.status, s.worker) for s in steps] == [
        ("first", 1, "completed", durable.engine.node)
    ]
    row = _row(durable, run_id)
    assert (row.step_index, row.status, row.locked_by, row.published) == (1, "running", None, True)
    assert durable.run_message("outage", 1, run_id) == "completed"


def test_a_write_an_outage_interrupted_meets_a_takeover_and_records_nothing(durable, monkeypatch):
    wf = durable.workflow("outage_taken")
    wf.step(lambda: 1, name="first")
    run_id = durable.start(wf)
    from durable_celery import DatabaseUnavailable

    real = type(durable.engine)._write_once
    failed: list[int] = []

    def write_once(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(1)
            _take_over(durable, run_id, "fenced")  # while the database was away
            raise DatabaseUnavailable("postgresql://db", "connection lost")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(type(durable.engine), "_write_once", write_once)
    assert durable.run_message("outage_taken", 0, run_id) == "fenced"
    assert durable.list_steps(run_id) == []


def test_a_compensation_an_outage_interrupted_is_recorded_once(durable, monkeypatch):
    from durable_celery.store.schema import steps

    _, run_id = _undo_flow(durable, lambda: "refunded")
    with durable.db.begin() as conn:  # the steps ran on another node: only the compensation's row is ours
        conn.execute(update(steps).where(steps.c.run_id == run_id).values(worker="elsewhere:1"))
    _answer_lost_once(monkeypatch, durable, commit=True)
    assert durable.run_message("undoing", 0, run_id, compensate=True) == "compensated"
    undone = [s for s in durable.list_steps(run_id) if s.phase == "compensate"]
    assert [(s.name, s.attempt, s.output) for s in undone] == [("first", 1, "refunded")]


def test_compensations_run_back_to_front_each_sent_on_its_queue(durable):
    wf = durable.workflow("undo_chain")
    done: list[str] = []
    wf.step(lambda: 1, name="a", compensate=lambda: done.append("undo a") or "a undone")
    wf.step(lambda: 2, name="b", compensate=lambda: done.append("undo b") or "b undone")

    @wf.step
    def c():
        raise ValueError("declined")

    run_id = durable.start(wf)
    for index in range(2):
        assert durable.run_message("undo_chain", index, run_id) == "running"
    assert durable.run_message("undo_chain", 2, run_id) == "compensating"

    assert durable.run_message("undo_chain", 1, run_id, compensate=True) == "compensating"
    row = _row(durable, run_id)
    assert (row.status, row.step_index, row.step_name) == ("compensating", 0, "a")
    assert (row.attempt, row.losses) == (1, 0)
    assert row.queue == durable.app.conf.task_default_queue and row.published is True
    assert row.due_at is not None and row.locked_by is None

    assert durable.run_message("undo_chain", 0, run_id, compensate=True) == "compensated"
    row = _row(durable, run_id)
    assert (row.status, row.losses, row.due_at, row.locked_by) == ("compensated", 0, None, None)
    assert done == ["undo b", "undo a"]
    undone = [s for s in durable.list_steps(run_id) if s.phase == "compensate"]
    assert [(s.name, s.output, s.worker) for s in undone] == [
        ("b", "b undone", durable.engine.node),
        ("a", "a undone", durable.engine.node),
    ]


def test_a_compensation_that_snoozes_keeps_its_lines_on_the_entry(durable):
    import logging

    log = logging.getLogger("tests.engine.undo")

    def undo():
        if not durable.activity(kinds=["snoozed"], run_id=current_run().id):
            log.warning("refund API busy")
            current_run().snooze(0.05, reason="busy")
        return "refunded"

    _, run_id = _undo_flow(durable, undo)
    assert durable.run_message("undoing", 0, run_id, compensate=True) == "snoozed"
    (entry,) = durable.activity(kinds=["snoozed"], run_id=run_id)
    assert [r["body"] for r in entry.details["logs"]] == ["refund API busy"]
    assert entry.workflow == "undoing"
    time.sleep(0.1)
    assert durable.run_message("undoing", 0, run_id, compensate=True) == "compensated"


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
    row = _row(durable, run_id)
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
    row = _row(durable, run_id)
    assert (row.status, row.losses, row.due_at, row.locked_by) == ("compensation_failed", 0, None, None)
    assert row.finished_at is not None
    undone = [(s.attempt, s.status) for s in durable.list_steps(run_id) if s.phase == "compensate"]
    assert undone == [(1, "failed"), (2, "failed")]


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
def test_a_compensation_that_ends_after_a_takeover_records_nothing(durable, how):
    def undo():
        _take_over(durable, current_run().id, how)  # without a heartbeat to notice it
        return "refunded"

    _, run_id = _undo_flow(durable, undo)
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


def test_each_fenced_worker_is_counted_signalled_and_logged_with_the_runs_key(durable):
    wf = durable.workflow("fenced_twice")

    @wf.step
    def only():
        _take_over(durable, current_run().id, "fenced")
        return "too late"

    signalled: list[tuple[str, str, str]] = []

    def note(sender: Any, run_id: str, workflow: str, step: str, **_: Any) -> None:
        if sender is durable:
            signalled.append((run_id, workflow, step))

    signals.worker_fenced.connect(note, weak=False)
    try:
        first = durable.start(wf, key="k:1")
        second = durable.start(wf, key="k:2")
        assert durable.run_message("fenced_twice", 0, first) == "fenced"
        assert durable.run_message("fenced_twice", 0, second) == "fenced"
    finally:
        signals.worker_fenced.disconnect(note)
    assert durable.engine.fenced_count == 2
    assert signalled == [(first, "fenced_twice", "only"), (second, "fenced_twice", "only")]
    for run_id, key in ((first, "k:1"), (second, "k:2")):
        (entry,) = durable.activity(kinds=["worker_fenced"], run_id=run_id)
        assert (entry.workflow, entry.key) == ("fenced_twice", key)
        assert durable.list_steps(run_id) == []


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


# -- a parent parking for a child that finished meanwhile ----------------------------------------


def _parent_and_child(durable: Any) -> tuple[Any, Any]:
    child = durable.workflow("child")
    child.step(lambda n: n * 10, name="work")
    parent = durable.workflow("parent")

    @parent.step
    def gather():
        return current_run().call_workflow("child", {"n": 4})

    return parent, child


def _child_of(durable: Any, parent_id: str) -> str:
    with durable.db.engine.connect() as conn:
        return conn.execute(select(runs.c.id).where(runs.c.parent_id == parent_id)).scalar_one()


@pytest.mark.parametrize("taken", [False, True], ids=["parked", "taken-meanwhile"])
def test_a_parent_whose_child_finished_before_it_parked_is_due_at_once(durable, monkeypatch, taken):
    parent, _ = _parent_and_child(durable)
    run_id = durable.start(parent)
    real_park = type(durable.engine)._park

    def child_first(engine: Any, *args: Any, **kwargs: Any) -> Any:
        child_id = _child_of(durable, run_id)
        assert durable.run_message("child", 0, child_id) == "completed"  # its wake-up finds no waiter
        if taken:
            _take_over(durable, run_id, "fenced")
        return real_park(engine, *args, **kwargs)

    monkeypatch.setattr(type(durable.engine), "_park", child_first)
    status = durable.run_message("parent", 0, run_id)
    row = _row(durable, run_id)
    if taken:  # the park was refused: the run is left as the takeover left it
        assert status == "fenced"
        assert (row.status, row.due_at) == ("running", None)  # as the claim left it: not made due
        return
    assert status == "waiting"
    assert row.status == "waiting" and row.due_at is not None  # due again: the child is done
    monkeypatch.setattr(type(durable.engine), "_park", real_park)
    assert durable.run_message("parent", 0, run_id) == "completed"
    assert durable.get_run(run_id).output == 40


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


def test_a_wait_of_a_run_cancelled_meanwhile_is_not_parked(durable):
    wf = durable.workflow("cancelled_wait")

    @wf.step
    def wait():
        _take_over(durable, current_run().id, "cancelled")
        return current_run().wait_for_event("paid", timeout=60)

    run_id = durable.start(wf)
    assert durable.run_message("cancelled_wait", 0, run_id) == "cancelled"
    row = _row(durable, run_id)
    assert (row.status, row.wait_name) == ("cancelled", None)
    assert durable.activity(kinds=["worker_fenced"], run_id=run_id) == []


def test_a_lost_process_whose_run_was_taken_back_meanwhile_names_the_dead_process(durable, monkeypatch):
    """The worker records a dead pool process's attempt while another path (the stale sweep, a
    node that saw the process gone) already took the run back: the dropped result is the dead
    process's, and the entry names it, not the worker recording it."""
    wf = _lost_flow(durable, retry=2)
    run_id = durable.start(wf)
    assert durable.run_message("lossy", 0, run_id) == "running"
    _claimed_by_dead_process(durable, run_id, 1)
    real = type(durable.engine)._write

    def taken_first(engine: Any, *args: Any, **kwargs: Any) -> Any:
        _take_over(durable, run_id, "fenced")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(type(durable.engine), "_write", taken_first)
    assert durable.engine.record_lost(wf, wf.steps[1], run_id, DEAD_PID, "exit 1") == "fenced"
    (entry,) = durable.activity(kinds=["worker_fenced"], run_id=run_id)
    assert entry.details["node"] == process_node(DEAD_PID)
    assert [s.name for s in durable.list_steps(run_id)] == ["first"]


def test_a_lost_compensation_whose_run_was_taken_back_meanwhile_names_the_dead_process(durable, monkeypatch):
    """As above, for a compensation the dead process was running."""
    wf = _lost_flow(durable, retry=1)
    run_id = durable.start(wf)
    with durable.db.begin() as conn:  # a run compensating step 0 ("first")
        conn.execute(
            update(runs)
            .where(runs.c.id == run_id)
            .values(status="compensating", step_index=0, step_name="first", due_at=durable.db.utcnow())
        )
    _claimed_by_dead_process(durable, run_id, 0, compensate=True)
    real = type(durable.engine)._write

    def taken_first(engine: Any, *args: Any, **kwargs: Any) -> Any:
        _take_over(durable, run_id, "fenced")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(type(durable.engine), "_write", taken_first)
    status = durable.engine.record_lost(wf, wf.steps[0], run_id, DEAD_PID, "exit 1", compensate=True)
    assert status == "fenced"
    (entry,) = durable.activity(kinds=["worker_fenced"], run_id=run_id)
    assert (entry.details["step"], entry.details["node"]) == ("first", process_node(DEAD_PID))
    assert durable.list_steps(run_id) == []


# -- what a recorded step sends and resets ----------------------------------------------------


def _set_losses(durable: Any, run_id: str) -> None:
    """One loss of the step in progress; a run backing off made due now."""
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(losses=1))
        conn.execute(
            update(runs)
            .where(runs.c.id == run_id, runs.c.due_at.is_not(None))
            .values(due_at=durable.db.utcnow())
        )


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
        _set_losses(durable, run_id)  # a loss of the step in progress: gone once it is recorded
        seen.published.clear()
        assert durable.run_message("relayed", index, run_id, compensate=compensate) == status
        assert seen.published == ([message] if message else [])
        assert _row(durable, run_id).losses == 0, status
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
    _set_losses(durable, run_id)
    status = "failed" if fail else "completed"
    assert durable.run_message("single", 0, run_id) == status
    assert _row(durable, run_id).losses == 0
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
        _set_losses(durable, run_id)
        statuses.append(durable.run_message("budget", 0, run_id))
    assert statuses == ["retrying", "failed"]
    durable.retry(run_id)  # attempt 3, counted from 2: this attempt and one more
    for _ in range(2):
        _set_losses(durable, run_id)
        statuses.append(durable.run_message("budget", 0, run_id))
    assert statuses == ["retrying", "failed", "retrying", "failed"]
    assert _row(durable, run_id).attempt == 4


def test_an_outage_is_waited_out_in_pauses_never_longer_than_a_heartbeat(make_durable, monkeypatch, caplog):
    from durable_celery import DatabaseUnavailable
    from durable_celery import engine as engine_module

    durable = make_durable(heartbeat_interval=1.0)
    wf = durable.workflow("patient")
    wf.step(lambda: 1, name="only")
    run_id = durable.start(wf)
    real = type(durable.engine)._write_once
    pauses: list[float] = []

    def write_once(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if len(pauses) < 4:
            raise DatabaseUnavailable("postgresql://db", "connection refused")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(type(durable.engine), "_write_once", write_once)
    monkeypatch.setattr(engine_module.time, "sleep", pauses.append)
    assert durable.run_message("patient", 0, run_id) == "completed"
    assert pauses == [0.2, 0.4, 0.8, 1.0]  # doubling, up to the heartbeat interval
    said = [r.getMessage() for r in caplog.records if "its outcome is kept until then" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"durable: run {run_id}: database unavailable at")  # once


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


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "not-committed"])
def test_an_inline_chain_goes_on_after_an_outage_interrupted_a_write(durable, monkeypatch, seen, commit):
    from durable_celery import continuation

    wf = durable.workflow("chained")
    ran: list[int] = []
    for i in range(3):
        wf.step(lambda i=i: ran.append(i) or i, name=f"s{i}")
    run_id = durable.start(wf)
    if commit:  # the record (and its claim of the next step) committed, its answer lost
        from durable_celery import DatabaseUnavailable

        real, failed = continuation.claimed, []

        def claimed(row: Any, go_on: Any) -> None:
            if not failed:
                failed.append(1)
                raise DatabaseUnavailable("postgresql://db", "connection lost")
            real(row, go_on)

        monkeypatch.setattr(continuation, "claimed", claimed)
    else:
        failed = _answer_lost_once(monkeypatch, durable, commit)  # the first step's record
    seen.published.clear()

    queue = _row(durable, run_id).queue
    assert continuation.run_message(durable.engine, wf, wf.steps[0], run_id, False, queue).status == "running"

    assert failed == [1] and ran == [0, 1, 2]  # the next steps ran inline, in this call
    assert seen.published == []
    run = durable.get_run(run_id)
    assert (run.status, run.output) == ("completed", 2)
    steps = [(s.name, s.attempt, s.status) for s in durable.list_steps(run_id)]
    assert steps == [("s0", 1, "completed"), ("s1", 1, "completed"), ("s2", 1, "completed")]


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
        ("keyed", 1): ["UPDATE", "SELECT", "UPDATE", "INSERT"],  # the key row first, then the record
        ("child", 0): one,
        ("child", 1): ["UPDATE", "UPDATE", "INSERT", "UPDATE"],  # the record, then the parent
    }
    assert {durable.get_run(r).status for r in (plain, keyed, child)} == {"completed"}


def test_a_fenced_holders_end_leaves_the_run_waiting_behind_it_waiting(durable):
    wf = durable.workflow("fenced_holder", on_duplicate="run_again")
    wf.step(lambda: 1, name="first")

    @wf.step
    def second():
        _take_over(durable, current_run().id, "fenced")  # another worker has the run now

    holder = durable.start(wf, key="k")
    assert durable.run_message("fenced_holder", 0, holder) == "running"
    behind = durable.start(wf, key="k")
    assert durable.run_message("fenced_holder", 1, holder) == "fenced"
    assert durable.get_run(behind).status == "waiting"  # the holder has not ended
    assert durable.get_run(holder).status == "running"
    assert durable.activity(kinds=["key_handed_off"]) == []


def _waits_for_child(durable: Any, parent: str, child: str) -> None:
    """``parent`` waits for its children, ``child`` one of them (as start_workflow makes them)."""
    waits = {"status": "waiting", "due_at": None, "wait_name": CHILDREN_WAIT}
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == parent).values(**waits))
        conn.execute(update(runs).where(runs.c.id == child).values(parent_id=parent, parent_ref="c1"))


def test_a_keyed_childs_end_sends_the_run_waiting_behind_it_and_wakes_its_parent(durable, seen):
    wf = durable.workflow("kid", on_duplicate="run_again")
    wf.step(lambda: 1, name="first")
    wf.step(lambda: 2, name="second")
    parent = durable.start(wf)
    child = durable.start(wf, key="kid:1")
    _waits_for_child(durable, parent, child)
    assert durable.run_message("kid", 0, child) == "running"
    behind = durable.start(wf, key="kid:1")
    assert durable.get_run(behind).status == "waiting"
    seen.published.clear()
    assert durable.run_message("kid", 1, child) == "completed"
    # Both sent at once, not left to the relay: the run behind the key, and the woken parent.
    assert sorted(seen.published) == sorted([("kid", 0, behind, 1, "kid:1"), ("kid", 0, parent, 1, None)])
    assert durable.get_run(behind).status == "pending"
    assert _row(durable, parent).due_at is not None


def test_a_fenced_childs_end_does_not_wake_its_parent(durable):
    wf = durable.workflow("kid_fenced")

    @wf.step
    def only():
        _take_over(durable, current_run().id, "fenced")

    parent, child = durable.start(wf), durable.start(wf)
    _waits_for_child(durable, parent, child)
    assert durable.run_message("kid_fenced", 0, child) == "fenced"
    assert _row(durable, parent).due_at is None


def test_a_compensation_runs_on_past_a_shutdowns_grace_period(durable):
    entered, seen = threading.Event(), {}

    def undo():
        entered.set()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # well past the grace period, beating as it goes
            current_run().heartbeat()
            seen["shutting_down"] = current_run().shutting_down()
            time.sleep(0.01)
        return "refunded"

    wf = durable.workflow("refund_late")
    wf.step(lambda: 1, name="first", compensate=undo)

    @wf.step
    def second():
        raise ValueError("declined")

    run_id = durable.start(wf)
    assert durable.run_message("refund_late", 0, run_id) == "running"
    assert durable.run_message("refund_late", 1, run_id) == "compensating"
    result: dict[str, str] = {}

    def run() -> None:
        result["status"] = durable.run_message("refund_late", 0, run_id, compensate=True)

    runner = threading.Thread(target=run)
    try:
        runner.start()
        assert entered.wait(10)
        durable.engine.drain(0.2)
        runner.join(15)
        assert not runner.is_alive() and durable.engine.drain_over()
    finally:
        durable.engine.undrain()
    assert result == {"status": "compensated"} and seen == {"shutting_down": True}
    assert durable.get_run(run_id).status == "compensated"


def test_step_started_names_the_run_workflow_step_and_attempt(durable):
    started: list[dict[str, Any]] = []

    def note(sender: Any, **kwargs: Any) -> None:
        if sender is durable:
            kwargs.pop("signal", None)
            started.append(kwargs)

    signals.step_started.connect(note, weak=False)
    try:
        wf = durable.workflow("announced")

        @wf.step(retry=2, backoff=30)
        def only():
            if current_run().attempt == 1:
                raise RuntimeError("once")

        run_id = durable.start(wf)
        assert durable.run_message("announced", 0, run_id) == "retrying"
        _set_losses(durable, run_id)  # due now
        assert durable.run_message("announced", 0, run_id) == "completed"
    finally:
        signals.step_started.disconnect(note)
    assert started == [
        {"run_id": run_id, "workflow": "announced", "step": "only", "attempt": 1},
        {"run_id": run_id, "workflow": "announced", "step": "only", "attempt": 2},
    ]


def test_a_renamed_steps_message_result_carries_the_definition_changed_error(make_durable):
    old, new, _ = _builds(make_durable)
    run_id = _at_second_step(old)
    wf = new.workflows["flow"]
    result = new.engine.execute_with_result(wf, wf.steps[1], run_id, None, False)
    assert result.status == "definition_changed"
    assert type(result.error).__name__ == "DurableError"
    assert str(result.error) == "workflow 'flow' has no step 'charge' any more; retry once it is back"


def test_a_failed_attempts_message_result_has_its_exception_and_attempt(durable):
    wf = durable.workflow("failing_twice")

    @wf.step(retry=2, backoff=30)
    def only():
        raise RuntimeError(f"attempt {current_run().attempt}")

    run_id = durable.start(wf)
    results = []
    for _ in range(2):
        _set_losses(durable, run_id)
        results.append(durable.engine.execute_with_result(wf, wf.steps[0], run_id, None, False))
    assert [(r.status, str(r.error), r.attempt) for r in results] == [
        ("retrying", "attempt 1", 1),
        ("failed", "attempt 2", 2),
    ]
    assert not durable.engine.heartbeater.active  # each attempt's heartbeat ended with it


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


def test_the_heartbeat_thread_ends_when_idle_and_the_next_step_starts_another(durable, monkeypatch):
    """An idle process keeps no thread waking to heartbeat nothing; timeouts hold after a restart."""
    from durable_celery import heartbeat

    monkeypatch.setattr(heartbeat, "IDLE_EXIT", 0.2)
    wf = durable.workflow("beats_then_idles")

    @wf.step(timeout=0.3)
    def crawl(slow):
        deadline = time.monotonic() + (10 if slow else 0)
        while time.monotonic() < deadline:  # stopped by the heartbeat thread at its timeout
            time.sleep(0.01)
        return threading.current_thread().name

    beats = durable.engine.heartbeater
    assert durable.run_message("beats_then_idles", 0, durable.start(wf, {"slow": False})) == "completed"
    first = beats._thread
    assert first is not None
    first.join(timeout=10)  # nothing to watch: the thread ends by itself
    assert not first.is_alive() and beats._thread is None
    run_id = durable.start(wf, {"slow": True})
    assert durable.run_message("beats_then_idles", 0, run_id) == "failed"  # a new thread enforced it
    assert durable.list_steps(run_id)[0].error["type"] == "StepTimeout"
    assert beats._thread is not None and beats._thread is not first


def test_a_step_past_its_timeout_fails_the_attempt_naming_the_timeout(durable):
    wf = durable.workflow("too_slow")

    @wf.step(timeout=0.2)
    def crawl():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # stopped by the heartbeat thread at its timeout
            time.sleep(0.01)

    run_id = durable.start(wf)
    assert durable.run_message("too_slow", 0, run_id) == "failed"
    (attempt,) = durable.list_steps(run_id)
    assert (attempt.error["type"], attempt.error["message"]) == (
        "StepTimeout",
        "step 'crawl' ran past its timeout of 0.2s",
    )


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
def test_a_step_whose_run_was_taken_before_its_record_records_nothing_and_says_why(make_durable, how):
    """The step returned, but the run was taken over or cancelled before its record (no beat in
    between to stop it): the record is refused, and the message's result tells which."""
    durable = make_durable(heartbeat_interval=30, stale_lock_timeout=120)
    wf = durable.workflow("taken_at_the_end")

    @wf.step
    def only():
        _take_over(durable, current_run().id, how)
        return "done"

    run_id = durable.start(wf)
    assert durable.run_message("taken_at_the_end", 0, run_id) == how
    assert durable.list_steps(run_id) == []
    entries = durable.activity(kinds=["worker_fenced"], run_id=run_id)
    assert (durable.engine.fenced_count, len(entries)) == ((1, 1) if how == "fenced" else (0, 0))


def test_step_finished_names_the_run_workflow_step_attempt_status_and_duration(durable):
    finished: list[dict[str, Any]] = []

    def note(sender: Any, **kwargs: Any) -> None:
        if sender is durable:
            kwargs.pop("signal", None)
            finished.append(kwargs)

    signals.step_finished.connect(note, weak=False)
    try:
        wf = durable.workflow("timed")

        @wf.step(retry=2, backoff=30)
        def only():
            time.sleep(0.05)  # a duration to measure
            if current_run().attempt == 1:
                raise RuntimeError("once")

        run_id = durable.start(wf)
        assert durable.run_message("timed", 0, run_id) == "retrying"
        _set_losses(durable, run_id)  # due now
        assert durable.run_message("timed", 0, run_id) == "completed"
    finally:
        signals.step_finished.disconnect(note)
    durations = [f.pop("duration") for f in finished]
    assert finished == [
        {"run_id": run_id, "workflow": "timed", "step": "only", "attempt": 1, "status": "failed"},
        {"run_id": run_id, "workflow": "timed", "step": "only", "attempt": 2, "status": "completed"},
    ]
    recorded = durable.list_steps(run_id)
    for duration, step in zip(durations, recorded, strict=True):
        assert 0.05 <= duration == (step.finished_at - step.started_at).total_seconds() < 10


def test_current_run_shows_a_step_its_run_as_claimed(durable):
    """``current_run()``: the run's id, workflow, input, context so far, key and attempt, and
    the step's own name (a keyed run here, on its second step, second attempt)."""
    seen: list[dict[str, Any]] = []
    wf = durable.workflow("shown")

    @wf.step
    def first(order):
        current_run().context["charged"] = order
        return 1

    @wf.step(retry=2, backoff=30)
    def second(order):
        run = current_run()
        seen.append(
            {
                "id": run.id,
                "workflow": run.workflow,
                "input": run.input,
                "context": dict(run.context),
                "attempt": run.attempt,
                "key": run.key,
                "step": run.step,
                "parent_id": run.parent_id,
            }
        )
        if run.attempt == 1:
            raise RuntimeError("once")

    run_id = durable.start(wf, {"order": 7}, key="order:7")
    assert durable.run_message("shown", 0, run_id) == "running"
    assert durable.run_message("shown", 1, run_id) == "retrying"
    _set_losses(durable, run_id)  # due now
    assert durable.run_message("shown", 1, run_id) == "completed"
    shown = {
        "id": run_id,
        "workflow": "shown",
        "input": {"order": 7},
        "context": {"charged": 7},
        "key": "order:7",
        "step": "second",
        "parent_id": None,
    }
    assert seen == [{**shown, "attempt": 1}, {**shown, "attempt": 2}]


def test_each_step_of_a_parent_starts_a_child_of_its_own_that_names_the_parent(durable):
    """A child's ``current_run().parent_id`` is its parent's id; a step's children are told
    apart from another step's (by the step's index), so the second step's call starts a new
    child rather than getting the first step's."""
    parents: list[str | None] = []
    kid = durable.workflow("kid")

    @kid.step
    def work(n):
        parents.append(current_run().parent_id)
        return n * 10

    mom = durable.workflow("mom")
    mom.step(lambda: current_run().call_workflow("kid", {"n": 1}), name="first")
    mom.step(lambda: current_run().call_workflow("kid", {"n": 2}), name="second")

    run_id = durable.start(mom)
    outputs = []
    for index in (0, 1):
        assert durable.run_message("mom", index, run_id) == "waiting"
        children = [c.id for c in durable.list_children(run_id)]
        assert len(children) == index + 1
        assert durable.run_message("kid", 0, children[-1]) == "completed"
        outputs.append(durable.run_message("mom", index, run_id))
    assert outputs == ["running", "completed"]
    assert durable.get_run(run_id).output == 20
    assert parents == [run_id, run_id]


def test_drain_outside_a_worker_signals_no_process(durable, monkeypatch):
    """An engine not (yet) in a worker knows no worker process: ``drain()`` shuts down the
    worker loop of this process (none here) and signals nobody."""
    from celery.worker import state

    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    monkeypatch.setattr(state, "should_stop", None)
    try:
        durable.drain()
        assert durable.engine.shutting_down() and state.should_stop == 0
    finally:
        durable.engine.undrain()
    assert signalled == []


def _task_events_of_a_message(durable: Any, run_id: str) -> list[str]:
    """Hand the run's first step message to its Celery task in this process (as a worker on the
    test's queue would) and return the types of the task events sent meanwhile."""
    import uuid

    from celery.events.event import get_exchange
    from kombu import Consumer, Queue

    workflow = durable.workflows["evented"]
    types: list[str] = []

    def note(body: Any, message: Any) -> None:
        types.extend(event["type"] for event in (body if isinstance(body, list) else [body]))

    def drain(conn: Any, seconds: float) -> None:
        try:
            while True:
                conn.drain_events(timeout=seconds)
        except TimeoutError:
            pass

    with durable.app.connection_for_read() as conn:
        exchange = get_exchange(conn, name=durable.app.conf.event_exchange)  # fanout on Redis
        watch = Queue(f"events-{uuid.uuid4().hex[:8]}", exchange, routing_key="task.#", auto_delete=True)
        with Consumer(conn, queues=[watch], callbacks=[note], no_ack=True, accept=["json"]):
            drain(conn, 0.2)  # subscribed before the step runs
            task = durable.app.tasks[workflow.steps[0].task_name]
            task.apply(kwargs={"run_id": run_id}, routing_key=durable.app.conf.task_default_queue)
            drain(conn, 0.5)
    return types


def test_a_durable_sends_no_task_events_for_inline_steps_until_its_worker_says_it_sends_them(durable):
    """Outside a worker (or before its bootstep notes ``-E``), inline steps send no task
    events; once the worker sends them, the inline step shows as a task of its own."""
    wf = durable.workflow("evented")
    wf.step(lambda: 1, name="first")
    wf.step(lambda: 2, name="second")
    quiet = durable.start(wf)
    assert _task_events_of_a_message(durable, quiet) == []
    assert durable.get_run(quiet).status == "completed"  # the second step ran inline
    durable.engine.task_events.value = 1
    shown = durable.start(wf)
    assert _task_events_of_a_message(durable, shown)[:2] == ["task-received", "task-started"]
    assert durable.get_run(shown).status == "completed"
