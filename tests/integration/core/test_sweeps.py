"""The upkeep sweeps, each pass called once, directly: what it takes, returns, announces and
hands on, and how much one pass takes. The stale sweep hands back only locks older than the
timeout (and nothing that changed hands since it looked), and fails a run lost ``max_losses``
times; the timeout sweep fails only unfinished runs past their deadline and hands their key on;
the wake-up sweep, the orphan sweep and the activity trim.

On both backends; rows are put in the state a case needs by writing them directly, messages are
recorded instead of sent. Written against mutants of durable_celery/store/queries.py and
durable_celery/worker/upkeep.py that the behaviour tests let through."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update

from durable_celery.core import sweeps
from durable_celery.store import activity_rows, event_rows
from durable_celery.store.schema import activity, runs
from tests.integration.helpers import (
    Steps,
    ago,
    key_holders,
    run_row,
    set_run,
    set_waiting,
    started_run,
    two_step_workflow,
)

pytestmark = pytest.mark.timeout(60)


# -- the stale sweep ----------------------------------------------------------------------------


def _locked(durable: Any, run_id: str, beat_ago: float, **values: Any) -> None:
    set_run(
        durable,
        run_id,
        status=values.pop("status", "running"),
        locked_by="gone:1:1",
        heartbeat_at=ago(durable, beat_ago),
        fence=4,
        due_at=None,
        **values,
    )


def test_the_stale_sweep_hands_back_only_locks_older_than_the_timeout(make_durable):
    durable = make_durable(stale_lock_timeout=30, max_losses=3)
    steps = Steps(durable)
    stale, fresh, pending = (durable.start(steps.wf) for _ in range(3))
    _locked(durable, stale, 60, losses=1)
    _locked(durable, fresh, 10)
    assert sweeps.sweep_stale_once(durable.runtime) == ([stale], [])
    row = run_row(durable, stale)
    assert (row.status, row.locked_by, row.heartbeat_at, row.fence, row.losses) == (
        "running",
        None,
        None,
        5,
        2,
    )
    assert (row.published, row.finished_at) == (False, None) and row.due_at is not None
    assert run_row(durable, fresh).locked_by == "gone:1:1" and run_row(durable, fresh).fence == 4
    assert run_row(durable, pending).status == "pending"
    entry = durable.activity(kinds=["stale_recovered"], run_id=stale)[0]
    assert (entry.details["locked_by"], entry.details["losses"], entry.details["failed"]) == (
        "gone:1:1",
        2,
        False,
    )
    assert sweeps.sweep_stale_once(durable.runtime) == ([], [])  # handed back once


def test_the_stale_sweep_takes_back_a_batch_a_pass(make_durable, monkeypatch):
    """A pass is bounded (``sweeps.BATCH`` runs), as the timeout sweep's is."""
    monkeypatch.setattr(sweeps, "BATCH", 2)
    durable = make_durable(stale_lock_timeout=30, max_losses=3)
    steps = Steps(durable)
    stale = [durable.start(steps.wf) for _ in range(3)]
    for run_id in stale:
        _locked(durable, run_id, 60)
    first, failed = sweeps.sweep_stale_once(durable.runtime)
    assert len(first) == 2 and failed == []
    assert sweeps.sweep_stale_once(durable.runtime) == (sorted(set(stale) - set(first)), [])
    assert sweeps.sweep_stale_once(durable.runtime) == ([], [])


def test_locks_still_beating_do_not_use_up_the_stale_sweeps_batch(make_durable, monkeypatch):
    """Only stale locks are read: runs whose workers beat, however many and wherever they lie,
    never fill a pass's batch while a lost run waits behind them."""
    monkeypatch.setattr(sweeps, "BATCH", 1)
    durable = make_durable(stale_lock_timeout=30, max_losses=3)
    steps = Steps(durable)
    beating = [durable.start(steps.wf) for _ in range(3)]
    stale = durable.start(steps.wf)
    for run_id in beating:
        _locked(durable, run_id, 1)
    _locked(durable, stale, 60)
    assert sweeps.sweep_stale_once(durable.runtime) == ([stale], [])
    assert all(run_row(durable, run_id).locked_by == "gone:1:1" for run_id in beating)


@pytest.mark.parametrize("status", ["running", "compensating"])
def test_the_stale_sweep_fails_a_run_lost_max_losses_times(make_durable, status):
    durable = make_durable(stale_lock_timeout=30, max_losses=3)
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    _locked(durable, run_id, 60, losses=2, status=status)
    set_run(durable, run_id, due_at=ago(durable, 1))  # a failed run is due no more
    assert sweeps.sweep_stale_once(durable.runtime) == ([], [run_id])
    row = run_row(durable, run_id)
    ended = "compensation_failed" if status == "compensating" else "failed"
    assert (row.status, row.locked_by, row.fence, row.losses, row.due_at) == (ended, None, 5, 3, None)
    assert row.finished_at is not None
    assert row.error == {
        "type": "WorkerLost",
        "message": "the run's worker was lost 3 times during one step",
        "traceback": None,
    }
    assert durable.activity(kinds=["stale_recovered"])[0].details["failed"] is True


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite: the sweep's transaction writes alone
@pytest.mark.parametrize("meanwhile", ["cancelled", "claimed_again"])
def test_the_stale_sweep_takes_back_nothing_that_changed_hands_since_it_looked(durable, meanwhile):
    from sqlalchemy import event

    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    _locked(durable, run_id, 3600)
    done: list[bool] = []

    def change_hands(conn, cursor, statement, parameters, context, executemany):
        # The sweep read the lock as stale; just before its take-back the run was cancelled
        # (unlocked, its last beat kept) or taken over by a worker that then went silent too.
        if done or not statement.startswith("UPDATE durable_runs"):
            return
        done.append(True)
        changed = {"locked_by": None, "status": "cancelled"}
        if meanwhile == "claimed_again":
            changed = {"locked_by": "other:2:2", "fence": runs.c.fence + 1}
        with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as other:
            other.execute(update(runs).where(runs.c.id == run_id).values(**changed))

    event.listen(durable.db.engine, "before_cursor_execute", change_hands)
    try:
        assert sweeps.sweep_stale_once(durable.runtime) == ([], [])
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", change_hands)
    assert done and durable.activity(kinds=["stale_recovered"]) == []
    assert run_row(durable, run_id).losses == 0


@pytest.mark.parametrize("status", ["running", "compensating"])
def test_the_stale_sweep_records_and_announces_a_run_lost_for_good(make_durable, status):
    durable = make_durable(max_losses=2)
    wf = two_step_workflow(durable)
    run_id = durable.start(wf, {"n": 1}, key="k")
    also = durable.start(wf, {"n": 2})  # lost for good too: the pass goes on to it
    lock = {"locked_by": "gone:1:1", "heartbeat_at": ago(durable, 3600), "losses": 1}
    set_run(durable, run_id, status=status, started_at=ago(durable, 3600), **lock)
    set_run(durable, also, status="running", started_at=ago(durable, 3600), **lock)
    finished: list[dict[str, Any]] = []
    recovered: list[dict[str, Any]] = []

    def receive(into: list[dict[str, Any]]) -> Any:
        def store(sender: Any, **kwargs: Any) -> None:
            if sender is durable:
                kwargs.pop("signal", None)
                into.append(kwargs)

        return store

    from durable_celery import signals

    on_finished, on_recovered = receive(finished), receive(recovered)
    signals.run_finished.connect(on_finished, weak=False)
    signals.stale_recovered.connect(on_recovered, weak=False)
    try:
        handed_back, failed = sweeps.sweep_stale_once(durable.runtime)
    finally:
        signals.run_finished.disconnect(on_finished)
        signals.stale_recovered.disconnect(on_recovered)
    assert (handed_back, sorted(failed)) == ([], sorted([run_id, also]))
    assert recovered == [{"run_ids": [], "failed_ids": failed}]
    ended = "compensation_failed" if status == "compensating" else "failed"
    assert {"run_id": run_id, "workflow": wf.name, "status": ended} in finished
    assert {"run_id": also, "workflow": wf.name, "status": "failed"} in finished and len(finished) == 2
    assert run_row(durable, run_id).status == ended
    (entry,) = [e for e in durable.activity(kinds=["stale_recovered"]) if e.run_id == run_id]
    assert entry.workflow == wf.name
    details = {"key": "k", "workflow": wf.name, "locked_by": "gone:1:1", "losses": 2, "failed": True}
    assert entry.details == details


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite: the sweep's transaction writes alone
def test_a_stale_run_that_beats_again_before_the_take_back_is_left_alone(durable):
    from sqlalchemy import event, update

    from durable_celery.store.schema import runs

    wf = two_step_workflow(durable)
    run_id = durable.start(wf, {"n": 1})
    set_run(durable, run_id, status="running", locked_by="slow:1:1", heartbeat_at=ago(durable, 3600))
    beaten: list[bool] = []

    def beat_first(conn, cursor, statement, parameters, context, executemany):
        # The sweep read the run as stale; its worker beats just before the take-back.
        if beaten or not statement.startswith("UPDATE durable_runs"):
            return
        beaten.append(True)
        with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as other:
            other.execute(update(runs).where(runs.c.id == run_id).values(heartbeat_at=durable.db.utcnow()))

    event.listen(durable.db.engine, "before_cursor_execute", beat_first)
    try:
        assert sweeps.sweep_stale_once(durable.runtime) == ([], [])
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", beat_first)
    assert beaten and run_row(durable, run_id).locked_by == "slow:1:1"
    assert durable.activity(kinds=["stale_recovered"]) == []


# -- the timeout sweep --------------------------------------------------------------------------


def test_the_timeout_sweep_fails_only_unfinished_runs_past_their_deadline(durable):
    steps = Steps(durable, timeout=600)
    over, early, done, none, parked, queued = (durable.start(steps.wf) for _ in range(6))
    set_run(
        durable,
        over,
        status="running",
        locked_by="w:1:1",
        heartbeat_at=ago(durable, 1),
        deadline_at=ago(durable, 5),
    )
    set_run(durable, parked, status="waiting", wait_name="approval", due_at=None, deadline_at=ago(durable, 4))
    set_run(durable, queued, deadline_at=ago(durable, 3))  # pending, never claimed
    set_run(durable, early, deadline_at=durable.db.utcnow() + timedelta(seconds=60))
    set_run(durable, done, status="completed", finished_at=ago(durable, 9), deadline_at=ago(durable, 5))
    set_run(durable, none, deadline_at=None)
    assert sorted(sweeps.fail_overdue_once(durable.runtime)) == sorted([over, parked, queued])
    assert [run_row(durable, r).status for r in (parked, queued)] == ["failed", "failed"]
    row = run_row(durable, over)
    assert (row.status, row.locked_by, row.heartbeat_at, row.due_at) == ("failed", None, None, None)
    assert row.finished_at is not None
    assert row.error == {
        "type": "WorkflowTimeout",
        "traceback": None,
        "message": "the run did not finish within its timeout of 600s",
    }
    assert [run_row(durable, r).status for r in (early, done, none)] == ["pending", "completed", "pending"]
    assert sweeps.fail_overdue_once(durable.runtime) == []


def test_the_timeout_sweep_ends_a_batch_a_pass(durable, monkeypatch):
    """A pass is bounded (``sweeps.BATCH`` runs), so the sweeper's other work is never held up."""
    monkeypatch.setattr(sweeps, "BATCH", 2)
    steps = Steps(durable, timeout=600)
    late = [durable.start(steps.wf) for _ in range(3)]
    for run_id in late:
        set_run(durable, run_id, deadline_at=ago(durable, 5))
    first = sweeps.fail_overdue_once(durable.runtime)
    assert len(first) == 2
    assert sweeps.fail_overdue_once(durable.runtime) == sorted(set(late) - set(first))
    assert sweeps.fail_overdue_once(durable.runtime) == []


def test_the_timeout_sweep_announces_the_end_and_hands_the_key_to_the_run_waiting_behind(durable, seen):
    wf = two_step_workflow(durable, reuse="after_failure", timeout=600)  # a failed holder frees the key
    holder = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, holder, status="running", started_at=ago(durable, 9), locked_by="w:1:1")
    set_run(durable, holder, heartbeat_at=ago(durable, 1), deadline_at=ago(durable, 1))
    behind = durable.start(wf, {"n": 2}, key="k", on_duplicate="run_again")
    assert key_holders(durable, wf.name) == (holder, behind)
    seen.clear()
    assert sweeps.fail_overdue_once(durable.runtime) == [holder]
    assert ("run_finished", {"run_id": holder, "workflow": wf.name, "status": "failed"}) in seen.signals
    assert key_holders(durable, wf.name) == (behind, None)
    assert run_row(durable, behind).status == "pending"
    assert seen.published == [(wf.name, 0, behind, 1, "k")]


def test_the_timeout_sweep_fails_an_overdue_run_of_a_workflow_this_code_lacks(durable):
    wf = two_step_workflow(durable)
    run_id = durable.start(wf, {"n": 1})
    set_run(durable, run_id, workflow="renamed_since", deadline_at=ago(durable, 1))
    assert sweeps.fail_overdue_once(durable.runtime) == [run_id]
    failed = run_row(durable, run_id)
    assert failed.status == "failed"
    assert failed.error["message"] == "the run did not finish within its timeout of Nones"


# -- the other sweeps ---------------------------------------------------------------------------


def test_the_wake_up_sweep_counts_the_runs_it_woke(durable, seen):
    wf = two_step_workflow(durable)
    first, second, not_kept = (durable.start(wf, {"n": n}) for n in range(3))
    for run_id in (first, second, not_kept):
        set_waiting(durable, run_id)
    with durable.db.begin() as conn:  # kept for them, but their wake-up was never sent
        event_rows.insert_event_txn(durable.db, conn, first, "paid", {"n": 1})
        event_rows.insert_event_txn(durable.db, conn, second, "paid", {"n": 2})
    assert sweeps.wake_missed_once(durable.runtime) == 2
    assert [run_row(durable, r).due_at is not None for r in (first, second, not_kept)] == [True, True, False]
    assert sweeps.wake_missed_once(durable.runtime) == 0


def test_each_sweep_takes_one_batch_a_pass(durable, seen, monkeypatch):
    monkeypatch.setattr(sweeps, "BATCH", 2)
    wf = two_step_workflow(durable)
    stale = [durable.start(wf, {"n": n}) for n in range(3)]
    for run_id in stale:
        set_run(durable, run_id, status="running", locked_by="gone:1:1", heartbeat_at=ago(durable, 3600))
    handed_back, failed = sweeps.sweep_stale_once(durable.runtime)
    assert (len(handed_back), failed) == (2, [])
    assert sweeps.sweep_stale_once(durable.runtime)[0] == [r for r in stale if r not in handed_back]

    missed = [durable.start(wf, {"n": n}) for n in range(3)]
    for run_id in missed:
        set_waiting(durable, run_id)
        with durable.db.begin() as conn:
            event_rows.insert_event_txn(durable.db, conn, run_id, "paid", None)
    assert sweeps.wake_missed_once(durable.runtime) == 2
    assert sweeps.wake_missed_once(durable.runtime) == 1

    parent = durable.start(wf, {"n": 9})
    set_run(durable, parent, status="cancelled", finished_at=durable.db.utcnow())
    children = [durable.start(wf, {"n": n}) for n in range(3)]
    for child in children:
        set_run(durable, child, parent_id=parent)
    assert len(sweeps.cancel_orphans_once(durable.runtime)) == 2
    assert len(sweeps.cancel_orphans_once(durable.runtime)) == 1
    assert {run_row(durable, c).status for c in children} == {"cancelled"}


def test_the_activity_trim_deletes_only_what_is_over_a_week_old(durable):
    with durable.db.begin() as conn:
        for what in ("recent", "old"):
            activity_rows.record_txn(durable.db, conn, what, None, None, None, {})
        conn.execute(update(activity).where(activity.c.kind == "old").values(at=ago(durable, 8 * 86400)))
    assert sweeps.trim_activity_once(durable.db) == 1
    assert [e.kind for e in durable.activity(kinds=["recent", "old"])] == ["recent"]
