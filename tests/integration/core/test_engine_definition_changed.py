"""A step renamed between builds, met by the engine (the message names the new step at the
run's index): the run fails with ``definition_changed``, or is handed back without an attempt
when a live node still has the old step; and what that meets: a run taken meanwhile, a run
waiting behind its key.

The old build (first, charge) and the new (first, take_payment) share one store.
Steps run through ``run_message``, as a worker runs a message, in the test's thread, on both
backends. Written against mutants of durable_celery/core/engine.py that the behaviour tests
(tests/integration/core/test_rollout.py, with real workers) never reached."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import update

from durable_celery import signals
from durable_celery.store import queries
from durable_celery.store.schema import runs
from durable_celery.worker.nodes import Node
from tests.integration.core.helpers import take_over_run
from tests.integration.helpers import run_row

pytestmark = pytest.mark.timeout(60)


def _finished(durable: Any) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []

    def note(sender: Any, run_id: str, status: str, **_: Any) -> None:
        if sender is durable:
            seen.append((run_id, status))

    signals.run_finished.connect(note, weak=False)
    return seen


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
    # The new build's first step has a compensation too: a definition_changed failure is not
    # the step's failure, so it undoes nothing, in either build.
    renamed.step(lambda: 1, name="first", compensate=lambda: calls.__setitem__("undo", calls["undo"] + 1))

    @renamed.step
    def take_payment():
        calls["take_payment"] += 1
        return "paid"

    return old, new, calls


def _at_second_step(old: Any) -> str:
    run_id = old.start("flow")
    assert old.run_message("flow", 0, run_id) == "running"
    row = run_row(old, run_id)
    assert (row.step_index, row.step_name, row.status) == (1, "charge", "running")
    return run_id


def test_a_step_renamed_in_the_new_build_fails_the_run_with_definition_changed(make_durable):
    old, new, calls = _builds(make_durable)
    run_id = _at_second_step(old)
    finished = _finished(new)
    before = run_row(old, run_id)

    assert new.run_message("flow", 1, run_id) == "definition_changed"

    assert calls == {"charge": 0, "take_payment": 0, "undo": 0}  # no step ran, nothing undone
    run = new.get_run(run_id)
    assert run.status == "failed" and run.finished_at is not None
    assert run.error["type"] == "definition_changed"
    assert run.error["message"] == "workflow 'flow' has no step 'charge' any more; retry once it is back"
    row = run_row(new, run_id)
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


def test_a_renamed_steps_message_result_carries_the_definition_changed_error(make_durable):
    old, new, _ = _builds(make_durable)
    run_id = _at_second_step(old)
    wf = new.workflows["flow"]
    result = new.engine.execute_with_result(wf, wf.steps[1], run_id, None, False)
    assert result.status == "definition_changed"
    assert type(result.error).__name__ == "DurableError"
    assert str(result.error) == "workflow 'flow' has no step 'charge' any more; retry once it is back"


def test_a_step_a_live_node_still_has_is_handed_back_to_it_without_an_attempt(make_durable):
    old, new, calls = _builds(make_durable, missing_code_retry=0.05)
    run_id = _at_second_step(old)
    elsewhere = Node(old.runtime, old.app)  # a live node of the old build, as the database sees one
    elsewhere.name = f"old-{run_id[:8]}@test"
    elsewhere.register()
    before = run_row(old, run_id)

    assert new.run_message("flow", 1, run_id) == "deferred"

    row = run_row(new, run_id)
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


def test_the_code_missing_entry_names_the_workflow(make_durable):
    old, new, _ = _builds(make_durable, missing_code_retry=0.05)
    run_id = _at_second_step(old)
    elsewhere = Node(old.runtime, old.app)
    elsewhere.name = f"old-{run_id[:8]}@test"
    elsewhere.register()
    assert new.run_message("flow", 1, run_id) == "deferred"
    (entry,) = new.activity(kinds=["code_missing"], run_id=run_id)
    assert entry.workflow == "flow"


def test_a_renamed_step_whose_hand_back_finds_the_run_gone_is_dropped(make_durable):
    old, new, _ = _builds(make_durable, missing_code_retry=0.05)
    run_id = _at_second_step(old)
    elsewhere = Node(old.runtime, old.app)
    elsewhere.name = f"old-{run_id[:8]}@test"
    elsewhere.register()
    original = queries.hand_back_txn

    def cancelled_first(db: Any, conn: Any, rid: str, fence: int, holder: str, seconds: float) -> bool:
        conn.execute(update(runs).where(runs.c.id == rid).values(fence=runs.c.fence + 1))
        return original(db, conn, rid, fence, holder, seconds)

    queries.hand_back_txn = cancelled_first
    try:
        assert new.run_message("flow", 1, run_id) == "dropped"
    finally:
        queries.hand_back_txn = original
    assert new.activity(kinds=["code_missing"], run_id=run_id) == []


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
def test_a_renamed_step_whose_run_was_taken_meanwhile_records_nothing(make_durable, how):
    old, new, _ = _builds(make_durable)
    run_id = _at_second_step(old)
    fenced: list[str] = []

    def taken_now(sender: Any, run_id: str, **_: Any) -> None:
        if sender is new:
            take_over_run(new, run_id, how)

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
