"""A pool process that died mid-step, as the worker that forked it records it
(``record_lost``): the attempt is used and the run backs off, or fails after compensating; a
compensation lost is recorded as one; a process that held nothing of the step changes nothing;
a run taken back meanwhile names the dead process.

A "dead pool process" is a lock written under that process's node name, as its claim wrote it.
Steps run through ``run_message``, as a worker runs a message, in the test's thread, on both
backends. Written against mutants of durable_celery/core/engine.py that the behaviour tests
(tests/e2e, with real prefork workers) never reached."""

from __future__ import annotations

import os
from typing import Any

import pytest
from sqlalchemy import update

from durable_celery import current_run
from durable_celery.core import flow
from durable_celery.core.engine import process_node
from durable_celery.models import aware
from durable_celery.store import queries
from durable_celery.store.schema import runs
from tests.integration.core.helpers import take_over_run
from tests.integration.helpers import run_row

pytestmark = pytest.mark.timeout(60)


DEAD_PID = 4_000_000  # above any pid_max: no live process of this host has it


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
    return run_row(durable, run_id)


def test_a_lost_process_uses_the_attempt_and_the_run_backs_off(durable):
    """Guards a past bug: on SQLite ``record_lost`` compared the database's naive
    heartbeat time with an aware clock and raised, so a pool process that died left its
    run locked until the stale sweep."""
    wf = _lost_flow(durable, retry=2)
    run_id = durable.start(wf)
    assert durable.run_message("lossy", 0, run_id) == "running"
    claimed = _claimed_by_dead_process(durable, run_id, 1)

    assert durable.engine.record_lost(wf, wf.steps[1], run_id, DEAD_PID, "signal 9 (SIGKILL)") == "retrying"

    row = run_row(durable, run_id)
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
    assert run_row(durable, run_id).attempt == 2
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
    before = run_row(durable, run_id)
    steps_before = durable.list_steps(run_id)

    status = durable.engine.record_lost(wf, step, run_id, DEAD_PID, "exit 1", compensate=compensate)
    assert status == "dropped"

    assert run_row(durable, run_id) == before
    assert durable.list_steps(run_id) == steps_before


def test_a_lost_process_of_a_waiting_run_moved_on_is_dropped(durable):
    wf = _lost_flow(durable, retry=2)
    run_id = durable.start(wf)
    assert durable.run_message("lossy", 0, run_id) == "running"
    _claimed_by_dead_process(durable, run_id, 1)
    with durable.db.begin() as conn:  # the lock a compensating run keeps, at another index
        conn.execute(update(runs).where(runs.c.id == run_id).values(status="compensating"))
    before = run_row(durable, run_id)

    assert durable.engine.record_lost(wf, wf.steps[0], run_id, DEAD_PID, "exit 1") == "dropped"
    assert run_row(durable, run_id) == before


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
    assert run_row(durable, run_id).context == {"charged": 10}

    _claimed_by_dead_process(durable, run_id, 0, compensate=True)
    assert durable.engine.record_lost(wf, wf.steps[0], run_id, DEAD_PID, "exit 1", compensate=True) == (
        "compensating"
    )
    lost = durable.list_steps(run_id)[-1]
    assert (lost.phase, lost.worker) == ("compensate", process_node(DEAD_PID))


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
        take_over_run(durable, run_id, "fenced")
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
        take_over_run(durable, run_id, "fenced")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(type(durable.engine), "_write", taken_first)
    status = durable.engine.record_lost(wf, wf.steps[0], run_id, DEAD_PID, "exit 1", compensate=True)
    assert status == "fenced"
    (entry,) = durable.activity(kinds=["worker_fenced"], run_id=run_id)
    assert (entry.details["step"], entry.details["node"]) == ("first", process_node(DEAD_PID))
    assert durable.list_steps(run_id) == []


@pytest.mark.parametrize("retry", [1, 2])
def test_a_lost_process_frees_its_slot_for_the_run_parked_behind_it(durable, retry):
    """The run failed, or backs off before its next attempt: either way its step holds the
    concurrency slot no more, and the run parked longest for it is woken."""
    wf = durable.workflow("limited", concurrency={"limit": 1, "key": "{tenant}"})

    @wf.step(retry=retry)
    def work(tenant):
        return tenant

    first, second = durable.start(wf, {"tenant": "t"}), durable.start(wf, {"tenant": "t"})
    assert flow.claim(durable.runtime, wf, wf.steps[0], first, f"{process_node(DEAD_PID)}:7", False)
    assert durable.engine.execute(wf, wf.steps[0], second, False) == "dropped"
    assert run_row(durable, second).flow_wait == "slot"

    status = durable.engine.record_lost(wf, wf.steps[0], first, DEAD_PID, "signal 9 (SIGKILL)")

    assert status == ("failed" if retry == 1 else "retrying")
    assert run_row(durable, second).flow_wait is None
