"""The conditions and values of the claim, the stale sweep and the timeout sweep, exactly
(mutants of durable_celery/store/queries.py and upkeep.py that the behaviour tests let through),
on both backends. Steps run through ``run_message``, as a worker runs a message, in this thread;
rows are put in the state a case needs by writing them directly."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from durable_celery import current_run, upkeep
from durable_celery.models import aware
from durable_celery.store import queries
from durable_celery.store.schema import runs
from durable_celery.store.schema import steps as step_rows

pytestmark = pytest.mark.timeout(60)


def _row(durable: Any, run_id: str) -> Any:
    with durable.db.engine.connect() as conn:
        return conn.execute(select(runs).where(runs.c.id == run_id)).one()


def _set(durable: Any, run_id: str, **values: Any) -> None:
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(**values))


def _ago(durable: Any, seconds: float) -> Any:
    return durable.db.utcnow() - timedelta(seconds=seconds)


class Steps:
    """A two-step workflow whose steps note the run's row as they see it while they run."""

    def __init__(self, durable: Any, **options: Any) -> None:
        self.durable = durable
        self.rows: list[Any] = []
        self.fail_first = options.pop("fail_first", False)
        self.wf = durable.workflow("claimed", **options)

        @self.wf.step(retry=2)
        def first():
            self.rows.append(_row(durable, current_run().id))
            if self.fail_first and len(self.rows) == 1:
                raise ValueError("first attempt fails")
            return "one"

        @self.wf.step
        def second():
            self.rows.append(_row(durable, current_run().id))
            return "two"

    def run(self, run_id: str, step: int) -> str:
        return self.durable.run_message("claimed", step, run_id)


@pytest.mark.parametrize(
    "state",
    [
        {"status": "completed"},
        {"status": "failed"},
        {"status": "cancelled"},
        {"status": "compensating"},
        {"status": "running", "locked_by": "elsewhere:1:1"},
        {"due_at": None},
        {"due_at": "later"},
    ],
    ids=["completed", "failed", "cancelled", "compensating", "locked", "not-due", "due-later"],
)
def test_a_run_that_is_not_claimable_is_dropped_untouched(durable, state):
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    if state.get("due_at") == "later":
        state = {"due_at": durable.db.utcnow() + timedelta(seconds=60)}
    _set(durable, run_id, **state)
    before = _row(durable, run_id)
    assert steps.run(run_id, 0) == "dropped"
    assert steps.rows == []
    assert _row(durable, run_id) == before


def test_a_message_for_another_step_is_dropped(durable):
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    before = _row(durable, run_id)
    assert steps.run(run_id, 1) == "dropped"
    assert _row(durable, run_id) == before


def test_a_claim_takes_the_lock_and_resets_the_relay_marks(durable):
    steps = Steps(durable, fail_first=True)
    run_id = durable.start(steps.wf)
    _set(durable, run_id, resends=3, resend_at=durable.db.utcnow(), published=True, due_at=_ago(durable, 1))
    assert steps.run(run_id, 0) == "retrying"
    claimed = steps.rows[0]
    assert (claimed.status, claimed.fence, claimed.resends, claimed.resend_at) == ("running", 1, 0, None)
    assert (claimed.published, claimed.due_at) == (False, None)
    assert claimed.locked_by is not None and claimed.heartbeat_at is not None
    assert claimed.started_at is not None and claimed.deadline_at is None
    after = _row(durable, run_id)  # the failed attempt's record: unlocked, attempt 2 due later
    assert (after.locked_by, after.heartbeat_at, after.attempt, after.published) == (None, None, 2, False)

    _set(durable, run_id, due_at=_ago(durable, 1))
    assert steps.run(run_id, 0) == "running"
    again = steps.rows[1]
    assert (again.fence, again.attempt) == (2, 2)
    assert again.started_at == claimed.started_at  # the first claim's, kept
    moved_on = _row(durable, run_id)
    assert (moved_on.step_index, moved_on.attempt, moved_on.published) == (1, 1, True)
    assert (moved_on.locked_by, moved_on.heartbeat_at) == (None, None)


def test_a_workflow_timeout_counts_from_the_first_claim_when_not_set_at_start(durable):
    steps = Steps(durable, timeout=600, fail_first=True)
    run_id = durable.start(steps.wf)
    _set(durable, run_id, deadline_at=None)  # as for a debounced or run_again run
    steps.run(run_id, 0)
    deadline = steps.rows[0].deadline_at
    expected = steps.rows[0].heartbeat_at + timedelta(seconds=600)
    assert abs((deadline - expected).total_seconds()) < 5
    _set(durable, run_id, due_at=_ago(durable, 1))
    steps.run(run_id, 0)
    assert steps.rows[1].deadline_at == deadline  # kept, not moved by the next claim


def _locked(durable: Any, run_id: str, beat_ago: float, **values: Any) -> None:
    _set(
        durable,
        run_id,
        status=values.pop("status", "running"),
        locked_by="gone:1:1",
        heartbeat_at=_ago(durable, beat_ago),
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
    assert upkeep.sweep_stale_once(durable) == ([stale], [])
    row = _row(durable, stale)
    assert (row.status, row.locked_by, row.heartbeat_at, row.fence, row.losses) == (
        "running",
        None,
        None,
        5,
        2,
    )
    assert (row.published, row.finished_at) == (False, None) and row.due_at is not None
    assert _row(durable, fresh).locked_by == "gone:1:1" and _row(durable, fresh).fence == 4
    assert _row(durable, pending).status == "pending"
    entry = durable.activity(kinds=["stale_recovered"], run_id=stale)[0]
    assert (entry.details["locked_by"], entry.details["losses"], entry.details["failed"]) == (
        "gone:1:1",
        2,
        False,
    )
    assert upkeep.sweep_stale_once(durable) == ([], [])  # handed back once


def test_the_stale_sweep_takes_back_a_batch_a_pass(make_durable, monkeypatch):
    """A pass is bounded (``RELAY_BATCH`` runs), as the timeout sweep's is."""
    monkeypatch.setattr(upkeep, "RELAY_BATCH", 2)
    durable = make_durable(stale_lock_timeout=30, max_losses=3)
    steps = Steps(durable)
    stale = [durable.start(steps.wf) for _ in range(3)]
    for run_id in stale:
        _locked(durable, run_id, 60)
    first, failed = upkeep.sweep_stale_once(durable)
    assert len(first) == 2 and failed == []
    assert upkeep.sweep_stale_once(durable) == (sorted(set(stale) - set(first)), [])
    assert upkeep.sweep_stale_once(durable) == ([], [])


def test_locks_still_beating_do_not_use_up_the_stale_sweeps_batch(make_durable, monkeypatch):
    """Only stale locks are read: runs whose workers beat, however many and wherever they lie,
    never fill a pass's batch while a lost run waits behind them."""
    monkeypatch.setattr(upkeep, "RELAY_BATCH", 1)
    durable = make_durable(stale_lock_timeout=30, max_losses=3)
    steps = Steps(durable)
    beating = [durable.start(steps.wf) for _ in range(3)]
    stale = durable.start(steps.wf)
    for run_id in beating:
        _locked(durable, run_id, 1)
    _locked(durable, stale, 60)
    assert upkeep.sweep_stale_once(durable) == ([stale], [])
    assert all(_row(durable, run_id).locked_by == "gone:1:1" for run_id in beating)


@pytest.mark.parametrize("status", ["running", "compensating"])
def test_the_stale_sweep_fails_a_run_lost_max_losses_times(make_durable, status):
    durable = make_durable(stale_lock_timeout=30, max_losses=3)
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    _locked(durable, run_id, 60, losses=2, status=status)
    _set(durable, run_id, due_at=_ago(durable, 1))  # a failed run is due no more
    assert upkeep.sweep_stale_once(durable) == ([], [run_id])
    row = _row(durable, run_id)
    ended = "compensation_failed" if status == "compensating" else "failed"
    assert (row.status, row.locked_by, row.fence, row.losses, row.due_at) == (ended, None, 5, 3, None)
    assert row.finished_at is not None
    assert row.error == {
        "type": "WorkerLost",
        "message": "the run's worker was lost 3 times during one step",
        "traceback": None,
    }
    assert durable.activity(kinds=["stale_recovered"])[0].details["failed"] is True


def test_the_timeout_sweep_fails_only_unfinished_runs_past_their_deadline(durable):
    steps = Steps(durable, timeout=600)
    over, early, done, none, parked, queued = (durable.start(steps.wf) for _ in range(6))
    _set(
        durable,
        over,
        status="running",
        locked_by="w:1:1",
        heartbeat_at=_ago(durable, 1),
        deadline_at=_ago(durable, 5),
    )
    _set(durable, parked, status="waiting", wait_name="approval", due_at=None, deadline_at=_ago(durable, 4))
    _set(durable, queued, deadline_at=_ago(durable, 3))  # pending, never claimed
    _set(durable, early, deadline_at=durable.db.utcnow() + timedelta(seconds=60))
    _set(durable, done, status="completed", finished_at=_ago(durable, 9), deadline_at=_ago(durable, 5))
    _set(durable, none, deadline_at=None)
    assert sorted(upkeep.fail_overdue_once(durable)) == sorted([over, parked, queued])
    assert [_row(durable, r).status for r in (parked, queued)] == ["failed", "failed"]
    row = _row(durable, over)
    assert (row.status, row.locked_by, row.heartbeat_at, row.due_at) == ("failed", None, None, None)
    assert row.finished_at is not None
    assert row.error == {
        "type": "WorkflowTimeout",
        "traceback": None,
        "message": "the run did not finish within its timeout of 600s",
    }
    assert [_row(durable, r).status for r in (early, done, none)] == ["pending", "completed", "pending"]
    assert upkeep.fail_overdue_once(durable) == []


def test_the_timeout_sweep_ends_a_batch_a_pass(durable, monkeypatch):
    """A pass is bounded (``RELAY_BATCH`` runs), so the sweeper's other work is never held up."""
    monkeypatch.setattr(upkeep, "RELAY_BATCH", 2)
    steps = Steps(durable, timeout=600)
    late = [durable.start(steps.wf) for _ in range(3)]
    for run_id in late:
        _set(durable, run_id, deadline_at=_ago(durable, 5))
    first = upkeep.fail_overdue_once(durable)
    assert len(first) == 2
    assert upkeep.fail_overdue_once(durable) == sorted(set(late) - set(first))
    assert upkeep.fail_overdue_once(durable) == []


def test_a_hand_back_frees_the_run_for_the_relay_later_only_under_its_fence(durable):
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    held = {"status": "running", "fence": 3, "locked_by": "w:1:1", "heartbeat_at": _ago(durable, 1)}
    _set(durable, run_id, published=True, **held)
    with durable.db.begin() as conn:
        assert queries.hand_back_txn(durable.db, conn, run_id, 2, 30) is False  # fenced out
    assert (_row(durable, run_id).locked_by, _row(durable, run_id).published) == ("w:1:1", True)
    before = durable.db.utcnow()
    with durable.db.begin() as conn:
        assert queries.hand_back_txn(durable.db, conn, run_id, 3, 30) is True
    row = _row(durable, run_id)
    assert (row.status, row.fence, row.attempt) == ("running", 3, 1)  # the same attempt, unrecorded
    assert (row.locked_by, row.heartbeat_at, row.published) == (None, None, False)  # the relay sends it
    due = row.due_at if row.due_at.tzinfo else row.due_at.replace(tzinfo=before.tzinfo)
    assert timedelta(seconds=29) <= due - before <= timedelta(seconds=40)


# -- statements read by the engine, rollout and the dashboard, called directly ------------------


def _runs(durable: Any, steps: Steps, n: int) -> list[str]:
    return [durable.start(steps.wf) for _ in range(n)]


def test_run_held_by_finds_a_run_only_under_its_holder_s_node_prefix(durable):
    steps = Steps(durable)
    mine, compensating, other_node, wildcard, unlocked, finished = _runs(durable, steps, 6)
    beat = _ago(durable, 1)
    _set(durable, mine, status="running", locked_by="w_1:9", heartbeat_at=beat)
    _set(durable, compensating, status="compensating", locked_by="w_1:7", heartbeat_at=beat)
    _set(durable, other_node, status="running", locked_by="w_12:9", heartbeat_at=beat)
    _set(durable, wildcard, status="running", locked_by="wx1:9", heartbeat_at=beat)  # `_` is literal
    _set(durable, finished, status="completed", locked_by="w_1:9")
    with durable.db.engine.connect() as conn:
        held = queries.run_held_by(conn, mine, "w_1:")
        assert (held.id, held.workflow, held.status, held.locked_by) == (mine, "claimed", "running", "w_1:9")
        assert held.heartbeat_at is not None and held.fence == 0
        assert queries.run_held_by(conn, compensating, "w_1:").status == "compensating"
        for run_id in (other_node, wildcard, unlocked, finished):
            assert queries.run_held_by(conn, run_id, "w_1:") is None


def test_step_recorded_matches_the_run_step_phase_attempt_and_worker_exactly(durable):
    steps = Steps(durable)
    run_id, other = _runs(durable, steps, 2)
    assert steps.run(run_id, 0) == "running"
    (first,) = durable.list_steps(run_id)
    with durable.db.engine.connect() as conn:
        exact = (run_id, 0, "step", first.attempt, first.worker)
        assert queries.step_recorded(conn, *exact) is True
        for changed in (
            (other, 0, "step", first.attempt, first.worker),
            (run_id, 1, "step", first.attempt, first.worker),
            (run_id, 0, "compensation", first.attempt, first.worker),
            (run_id, 0, "step", first.attempt + 1, first.worker),
            (run_id, 0, "step", first.attempt, first.worker + "x"),
        ):
            assert queries.step_recorded(conn, *changed) is False, changed


def test_pending_inputs_lists_runs_waiting_for_an_input_oldest_first(durable):
    steps = Steps(durable)
    newer, older, lookalike, running = (durable.start(steps.wf, key=f"k-{n}") for n in range(4))
    until = durable.db.utcnow() + timedelta(seconds=60)
    _set(durable, older, status="waiting", wait_name="in_put:a", wait_until=until)
    _set(durable, older, created_at=_ago(durable, 9))
    _set(durable, newer, status="waiting", wait_name="in_put:b", created_at=_ago(durable, 5))
    _set(durable, lookalike, status="waiting", wait_name="inXput:c")  # `_` is literal
    _set(durable, running, status="running", wait_name="in_put:d")
    with durable.db.engine.connect() as conn:
        found = queries.pending_inputs(conn, "in_put:", 10, None)
        assert [(r.id, r.workflow, r.wait_name, r.key) for r in found] == [
            (older, "claimed", "in_put:a", "k-1"),  # inserted second, created first
            (newer, "claimed", "in_put:b", "k-0"),
        ]
        assert found[0].wait_until is not None and found[1].wait_until is None
        assert [r.id for r in queries.pending_inputs(conn, "in_put:", 1, None)] == [older]


def test_count_runs_by_status_counts_each_workflow_and_status(durable):
    steps = Steps(durable)
    a, b, c = _runs(durable, steps, 3)
    _set(durable, c, status="completed")
    other = durable.workflow("other")
    other.step(lambda: None, name="only")
    durable.start(other)
    with durable.db.engine.connect() as conn:
        assert queries.count_runs_by_status(conn) == {
            ("claimed", "pending"): 2,
            ("claimed", "completed"): 1,
            ("other", "pending"): 1,
        }


@pytest.mark.parametrize("action", ["defer", "fail"])
def test_a_run_without_its_code_here_is_deferred_or_failed_only_if_unclaimed_at_that_step(durable, action):
    steps = Steps(durable)
    run_id, bystander, locked, moved_on, finished = _runs(durable, steps, 5)
    for r in (run_id, bystander, locked, moved_on, finished):
        _set(durable, r, step_index=1, published=True, due_at=_ago(durable, 1))
    _set(durable, locked, status="running", locked_by="w:1:1")
    _set(durable, moved_on, step_index=2)
    _set(durable, finished, status="completed")
    error = {"type": "definition_changed", "message": "gone", "traceback": None}
    before = durable.db.utcnow()

    def act(conn: Any, target: str) -> bool:
        if action == "defer":
            return queries.defer_unclaimed_txn(durable.db, conn, target, 1, 30)
        return queries.fail_unclaimed_txn(durable.db, conn, target, 1, error)

    with durable.db.begin() as conn:
        for target in (locked, moved_on, finished):
            assert act(conn, target) is False
        assert act(conn, run_id) is True
    row = _row(durable, run_id)
    if action == "defer":
        assert (row.status, row.published, row.error, row.finished_at) == ("pending", False, None, None)
        due = row.due_at if row.due_at.tzinfo else row.due_at.replace(tzinfo=before.tzinfo)
        assert timedelta(seconds=29) <= due - before <= timedelta(seconds=40)
    else:
        assert (row.status, row.published, row.error, row.due_at) == ("failed", False, error, None)
        assert row.finished_at is not None
    untouched = _row(durable, bystander)
    assert (untouched.status, untouched.published, untouched.due_at is not None) == ("pending", True, True)


def test_a_heartbeat_moves_the_lock_s_time_forward_only_under_its_fence(durable):
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    old = _ago(durable, 120)
    _set(durable, run_id, status="running", fence=4, locked_by="w:1:1", heartbeat_at=old)
    with durable.db.begin() as conn:
        assert queries.heartbeat_run(durable.db, conn, run_id, 3) is False  # fenced out
    before = _row(durable, run_id).heartbeat_at  # untouched by the fenced-out beat
    with durable.db.begin() as conn:
        assert queries.heartbeat_run(durable.db, conn, run_id, 4) is True
    after = _row(durable, run_id).heartbeat_at
    assert after is not None and after - before >= timedelta(seconds=119)


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
        assert upkeep.sweep_stale_once(durable) == ([], [])
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", change_hands)
    assert done and durable.activity(kinds=["stale_recovered"]) == []
    assert _row(durable, run_id).losses == 0


def test_a_claim_takes_only_the_run_it_names(durable):
    steps = Steps(durable)
    run_id, other = _runs(durable, steps, 2)
    before = _row(durable, other)
    with durable.db.begin() as conn:
        claimed = queries.claim_run(durable.db, conn, run_id, 0, "w:1:1")
    assert claimed.id == run_id
    assert _row(durable, other) == before


def test_a_claim_waits_while_the_run_s_queue_is_paused(durable):
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    queue = _row(durable, run_id).queue
    durable.pause_queue(queue)
    before = _row(durable, run_id)
    with durable.db.begin() as conn:
        assert queries.claim_run(durable.db, conn, run_id, 0, "w:1:1") is None
    assert _row(durable, run_id) == before
    durable.resume_queue(queue)
    with durable.db.begin() as conn:
        assert queries.claim_run(durable.db, conn, run_id, 0, "w:1:1").id == run_id


def test_a_compensation_claim_keeps_the_run_compensating(durable):
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    _set(durable, run_id, status="compensating", due_at=_ago(durable, 1), fence=2)
    with durable.db.begin() as conn:
        assert queries.claim_run(durable.db, conn, run_id, 0, "w:1:1") is None  # not a step's claim
        claimed = queries.claim_run(durable.db, conn, run_id, 0, "w:1:1", compensate=True)
    assert claimed.id == run_id
    row = _row(durable, run_id)
    assert (row.status, row.fence, row.locked_by, row.due_at) == ("compensating", 3, "w:1:1", None)


def test_a_run_due_at_the_claim_s_own_instant_is_claimed():
    # A Fake's clock stands still: a run started "now" is due at exactly the claim's "now".
    from durable_celery.testing import Fake

    fake = Fake()
    try:
        wf = fake.workflow("instant")
        wf.step(lambda: "done", name="only")
        run_id = fake.start(wf)
        fake.run_until_idle()
        assert fake.get_run(run_id).status == "completed"
    finally:
        fake.close()


def test_claims_with_and_without_a_timeout_each_keep_their_own_statement(durable):
    steps = Steps(durable)
    plain, timed = _runs(durable, steps, 2)
    _set(durable, timed, deadline_at=None)
    with durable.db.begin() as conn:  # the claim without a timeout is built (and cached) first
        assert queries.claim_run(durable.db, conn, plain, 0, "w:1:1").id == plain
        assert queries.claim_run(durable.db, conn, timed, 0, "w:1:1", timeout=600).id == timed
    assert _row(durable, plain).deadline_at is None
    assert _row(durable, timed).deadline_at is not None  # counted from this first claim


# -- readers: list_runs, pending inputs, what a Fake runs next ---------------------------------


def _one_step(durable: Any, name: str) -> Any:
    wf = durable.workflow(name)
    wf.step(lambda: 1, name="only")
    return wf


def test_list_runs_filters_by_workflow_key_and_status_newest_first(durable):
    a, b = _one_step(durable, "a_flow"), _one_step(durable, "b_flow")
    ids = [durable.start(a), durable.start(b), durable.start(a, key="k1"), durable.start(b)]
    _set(durable, ids[1], status="failed")
    newest = list(reversed(ids))

    def listed(**filters: Any) -> list[str]:
        return [r.id for r in durable.list_runs(**filters)]

    assert listed() == newest
    assert listed(workflow="a_flow") == [ids[2], ids[0]]
    assert listed(key="k1") == [ids[2]]
    assert listed(status="failed") == [ids[1]]
    assert listed(status=["failed", "pending"]) == newest
    assert listed(workflow="b_flow", status="pending") == [ids[3]]
    assert listed(limit=2) == newest[:2]
    # Newest by creation, then by id among runs created at the same instant.
    _set(durable, ids[0], created_at=durable.db.utcnow() + timedelta(hours=1))
    same = durable.db.utcnow() - timedelta(hours=1)
    _set(durable, ids[1], created_at=same)
    _set(durable, ids[3], created_at=same)
    assert listed() == [ids[0], ids[2], ids[3], ids[1]]


def test_pending_inputs_of_one_workflow_oldest_first_not_cut_by_others(durable):
    ask, other = durable.workflow("asks"), durable.workflow("others")

    @ask.step
    def wait_here():
        current_run().wait_for_input("approval", timeout=3600)

    @other.step
    def wait_there():
        current_run().wait_for_input("approval", timeout=3600)

    waiting = []
    for wf, name in [(other, "others"), (ask, "asks"), (ask, "asks"), (other, "others")]:
        run_id = durable.start(wf)
        assert durable.run_message(name, 0, run_id) == "waiting"
        waiting.append(run_id)
    old = durable.db.utcnow() - timedelta(hours=1)
    _set(durable, waiting[2], created_at=old)  # the older of the two asks
    _set(durable, waiting[0], created_at=old - timedelta(hours=1))  # the oldest of all: another's
    assert [p.run_id for p in durable.list_pending_inputs(workflow="asks")] == [waiting[2], waiting[1]]
    assert [p.run_id for p in durable.list_pending_inputs(workflow="asks", limit=1)] == [waiting[2]]
    assert [p.run_id for p in durable.list_pending_inputs(limit=1)] == [waiting[0]]
    everyone = [p.run_id for p in durable.list_pending_inputs()]
    assert everyone == [waiting[0], waiting[2], waiting[1], waiting[3]]


def test_a_fake_runs_what_is_due_oldest_due_first_and_leaves_the_rest():
    from durable_celery.testing import Fake

    fake = Fake()
    order: list[str] = []
    wf = fake.workflow("noted")

    @wf.step
    def note(tag):
        order.append(tag)

    ids = {tag: fake.start(wf, {"tag": tag}) for tag in ["a", "b", "c", "d", "e"]}
    # Runs started in the same millisecond have ids in random order: a's sorts last here.
    _set(fake, ids["a"], id="ffffffff" + ids["a"][8:])
    ids["a"] = "ffffffff" + ids["a"][8:]
    now = fake.db.utcnow()
    _set(fake, ids["d"], due_at=now - timedelta(seconds=20))
    _set(fake, ids["b"], due_at=now - timedelta(seconds=10))
    _set(fake, ids["a"], due_at=now - timedelta(seconds=5))
    _set(fake, ids["c"], due_at=now - timedelta(seconds=5))  # as due as a: the id decides
    _set(fake, ids["e"], due_at=now - timedelta(seconds=30), locked_by="another-worker:1")
    assert fake.run_until_idle() == 4
    assert order == ["d", "b", "c", "a"]  # the locked one is another worker's
    fake.close()


def test_a_fake_leaves_paused_queues_finished_runs_and_other_workflows_alone():
    from durable_celery.testing import Fake

    fake = Fake()
    ran: list[str] = []
    wf = fake.workflow("kept", queue="slow")

    @wf.step
    def note(tag):
        ran.append(tag)

    paused = fake.start(wf, {"tag": "paused"})
    fake.pause_queue("slow")
    assert fake.run_until_idle() == 0
    stray = fake.start(_one_step(fake, "stray"))
    _set(fake, stray, workflow="not_defined_here")  # another build's workflow on the store
    done = fake.start(_one_step(fake, "done"))
    _set(fake, done, status="cancelled", finished_at=fake.db.utcnow())  # its due_at left behind
    assert fake.run_until_idle() == 0
    fake.resume_queue("slow")
    assert fake.run_until_idle() == 1 and ran == ["paused"]
    assert fake.get_run(paused).status == "completed"
    fake.close()


def test_a_start_on_a_bare_connection_flags_only_its_own_run_for_the_relay(durable):
    """Its message waits for the relay (the commit is the caller's); runs already sent stay sent."""
    steps = Steps(durable)
    sent = durable.start(steps.wf)
    assert _row(durable, sent).published is True
    with durable.db.engine.begin() as conn:
        flagged = durable.start(steps.wf, connection=conn)
    assert _row(durable, flagged).published is False
    assert _row(durable, sent).published is True


def test_list_steps_is_in_the_order_recorded_wherever_the_rows_lie(durable):
    """By id: not by the unique index's order (a compensation of step 0 comes after step 1), nor
    by where PostgreSQL keeps the rows (an updated row moves to the end of its page)."""
    wf = durable.workflow("undone")
    wf.step(lambda: 1, name="first", compensate=lambda: None)

    @wf.step
    def second():
        raise ValueError("declined")

    run_id = durable.start(wf)
    assert durable.run_message("undone", 0, run_id) == "running"
    assert durable.run_message("undone", 1, run_id) == "compensating"
    assert durable.run_message("undone", 0, run_id, compensate=True) == "compensated"
    recorded = [(s.step_index, s.phase, s.status) for s in durable.list_steps(run_id)]
    assert recorded == [(0, "step", "completed"), (1, "step", "failed"), (0, "compensate", "completed")]
    first = (step_rows.c.run_id == run_id) & (step_rows.c.step_index == 0) & (step_rows.c.phase == "step")
    with durable.db.begin() as conn:  # the first row written, updated: a new version of it
        conn.execute(update(step_rows).where(first).values(logs=[]))
    assert [(s.step_index, s.phase, s.status) for s in durable.list_steps(run_id)] == recorded


@pytest.mark.parametrize("backend", ["postgres"])  # the broker's queue depth: Redis
def test_only_sent_unclaimed_runs_of_this_build_count_against_the_messages_queued(make_durable, redis_client):
    """A queue's runs re-sent are at most its sent, unclaimed, unfinished runs of the workflows
    this build knows, less the messages the broker holds: a run never sent (sent anyway), a
    finished one, or another build's run whose message was lost (that build's relay's to send
    again) must not get a re-send beside a message still queued."""
    from durable_celery.relay import relay_once

    ours = make_durable("ours", relay_after=0.5)
    _one_step(ours, "shipped")
    theirs = make_durable("theirs", relay_after=0.5)
    _one_step(theirs, "not_ours")
    queue = ours.app.conf.task_default_queue
    lost = theirs.start("not_ours")
    ended = ours.start("shipped")
    assert theirs.flush(timeout=10) and ours.flush(timeout=10)
    redis_client.delete(queue)  # the broker lost both messages
    _set(ours, ended, status="cancelled", finished_at=ours.db.utcnow())  # its due_at left behind
    with ours.db.engine.begin() as conn:
        unsent = ours.start("shipped", connection=conn)  # flagged for the relay
    queued = ours.start("shipped")
    assert ours.flush(timeout=10) and redis_client.llen(queue) == 1
    for run_id in (lost, ended, unsent, queued):  # due long enough to be looked at again
        _set(ours, run_id, due_at=_ago(ours, 60))
    try:
        assert relay_once(ours) == 1  # the unsent run's message
        assert redis_client.llen(queue) == 2
        assert (_row(ours, unsent).published, _row(ours, unsent).resends) == (True, 0)
        assert _row(ours, queued).resends == 0 and _row(ours, queued).resend_at is not None
        assert _row(ours, lost).resend_at is None and _row(ours, ended).resend_at is None  # not taken
    finally:
        redis_client.delete(queue)


@pytest.mark.parametrize("backend", ["postgres"])  # the broker's queue depth: Redis
def test_a_lost_message_is_sent_again_only_relay_after_its_run_became_due(make_durable, redis_client):
    from durable_celery.relay import relay_once

    durable = make_durable(relay_after=30)
    _one_step(durable, "shipped")
    queue = durable.app.conf.task_default_queue
    run_id = durable.start("shipped")
    assert durable.flush(timeout=10) and redis_client.llen(queue) == 1
    redis_client.delete(queue)  # lost at once
    try:
        assert relay_once(durable) == 0 and redis_client.llen(queue) == 0  # too soon to tell
        _set(durable, run_id, due_at=_ago(durable, 31))
        assert relay_once(durable) == 1 and redis_client.llen(queue) == 1
        assert _row(durable, run_id).resends == 1
    finally:
        redis_client.delete(queue)


def test_a_debounce_restarted_after_the_relay_sent_its_run_waits_its_whole_period(durable):
    """The relay sent a debounced run that no worker has claimed yet; a later start restarts
    the debounce (due later, unsent again): the relay's earlier mark to look again is no
    reason to send it before the new period ends."""
    from durable_celery.relay import relay_once

    wf = durable.workflow("indexed", debounce={"period": 60, "timeout": 600})
    wf.step(lambda rev: rev, name="index")
    run_id = durable.start(wf, {"rev": 1}, key="article:1")
    _set(durable, run_id, due_at=_ago(durable, 1))  # its first period is over
    assert relay_once(durable) == 1
    sent = _row(durable, run_id)  # the relay looks again relay_after (30 s) from now
    assert sent.published is True and aware(sent.resend_at) > durable.db.utcnow() + timedelta(seconds=20)
    assert durable.start(wf, {"rev": 2}, key="article:1") == run_id  # debounced: due in 60 s
    _set(durable, run_id, resend_at=_ago(durable, 1))  # the relay's mark came due meanwhile
    assert relay_once(durable) == 0
    row = _row(durable, run_id)
    assert row.published is False and aware(row.due_at) > durable.db.utcnow() + timedelta(seconds=50)


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite: one writer at a time, no row locks
def test_the_relay_passes_over_a_run_another_relay_holds(durable):
    """Relays on several nodes take due runs ``FOR UPDATE SKIP LOCKED``: a run another node's
    relay holds is left to it, and this pass sends the rest without waiting for that lock."""
    from sqlalchemy import event

    from durable_celery.relay import relay_once

    _one_step(durable, "shipped")
    with durable.db.engine.begin() as conn:  # two runs the relay must send
        held, free = (durable.start("shipped", connection=conn) for _ in range(2))

    def bounded(conn, cursor, statement, parameters, context, executemany):
        if "FOR UPDATE" in statement:  # a wait for the other relay's lock fails, never hangs
            cursor.execute("SET LOCAL lock_timeout = '2s'")

    other = durable.db.engine.connect()
    other.begin()
    other.execute(select(runs.c.id).where(runs.c.id == held).with_for_update())
    event.listen(durable.db.engine, "before_cursor_execute", bounded)
    try:
        assert relay_once(durable) == 1
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", bounded)
        other.rollback()
        other.close()
    assert (_row(durable, free).published, _row(durable, held).published) == (True, False)


def test_a_relay_pass_takes_its_runs_a_batch_at_a_time(durable, monkeypatch):
    """Each transaction of a pass locks at most ``RELAY_BATCH`` runs; the pass goes on until a
    batch comes back short."""
    from durable_celery import relay

    monkeypatch.setattr(relay, "RELAY_BATCH", 2)
    taken: list[int] = []
    real = queries.take_due_runs_txn

    def counted(*args: Any) -> Any:
        rows = real(*args)
        taken.append(len(rows))
        return rows

    monkeypatch.setattr(queries, "take_due_runs_txn", counted)
    _one_step(durable, "shipped")
    with durable.db.engine.begin() as conn:  # five runs the relay must send
        for _ in range(5):
            durable.start("shipped", connection=conn)
    assert relay.relay_once(durable) == 5
    assert taken == [2, 2, 1]


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite: one writer at a time, no row locks
def test_fetch_run_waits_for_the_row_lock_only_when_it_locks(durable):
    """``fetch_run(lock=True)`` (the cancel's read) waits for a transaction holding the run's row;
    a plain read does not."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    _one_step(durable, "shipped")
    run_id = durable.start("shipped")
    other = durable.db.engine.connect()
    other.begin()
    other.execute(select(runs.c.id).where(runs.c.id == run_id).with_for_update())
    try:
        with durable.db.engine.connect() as conn:
            with conn.begin():
                conn.execute(text("SET LOCAL lock_timeout = '300ms'"))
                assert queries.fetch_run(conn, run_id).id == run_id
            with pytest.raises(DBAPIError, match="lock timeout"), conn.begin():
                conn.execute(text("SET LOCAL lock_timeout = '300ms'"))
                queries.fetch_run(conn, run_id, lock=True)
    finally:
        other.rollback()
        other.close()


def test_a_claim_by_a_build_without_the_workflow_timeout_keeps_the_runs_deadline(make_durable):
    """A run started where its workflow had a timeout keeps its deadline when a worker of a
    build that dropped the timeout (a rolling deploy) claims it: the claim leaves it alone."""
    timed = Steps(make_durable("timed"), timeout=600)
    run_id = timed.durable.start(timed.wf)
    deadline = _row(timed.durable, run_id).deadline_at
    assert deadline is not None
    untimed = Steps(make_durable("untimed"))
    untimed.run(run_id, 0)
    assert len(untimed.rows) == 1  # claimed and ran
    assert untimed.rows[0].deadline_at == deadline  # as the step saw its claimed run
    assert _row(untimed.durable, run_id).deadline_at == deadline
