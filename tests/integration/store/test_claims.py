"""The claim's conditions and values, exactly: what a message's claim takes (the lock under a
new fence, the relay's marks reset, a workflow timeout's deadline) and what it leaves (a run not
claimable, another step's message, a paused queue, a run it does not name); and the statements
that move a held run only under its fence (a hand-back, a heartbeat) or only while unclaimed at
its step (a deferral or failure of a run whose code is not here).

On both backends. Steps run through ``run_message``, as a worker runs a message, in this thread;
rows are put in the state a case needs by writing them directly. Written against mutants of
durable_celery/store/queries.py that the behaviour tests let through."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from durable_celery.store import queries
from tests.integration.helpers import Steps, ago, run_row, set_run, start_runs

pytestmark = pytest.mark.timeout(60)


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
    set_run(durable, run_id, **state)
    before = run_row(durable, run_id)
    assert steps.run(run_id, 0) == "dropped"
    assert steps.rows == []
    assert run_row(durable, run_id) == before


def test_a_message_for_another_step_is_dropped(durable):
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    before = run_row(durable, run_id)
    assert steps.run(run_id, 1) == "dropped"
    assert run_row(durable, run_id) == before


def test_a_claim_takes_only_the_run_it_names(durable):
    steps = Steps(durable)
    run_id, other = start_runs(durable, steps, 2)
    before = run_row(durable, other)
    with durable.db.begin() as conn:
        claimed = queries.claim_run(durable.db, conn, run_id, 0, "w:1:1")
    assert claimed.id == run_id
    assert run_row(durable, other) == before


def test_a_claim_waits_while_the_run_s_queue_is_paused(durable):
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    queue = run_row(durable, run_id).queue
    durable.pause_queue(queue)
    before = run_row(durable, run_id)
    with durable.db.begin() as conn:
        assert queries.claim_run(durable.db, conn, run_id, 0, "w:1:1") is None
    assert run_row(durable, run_id) == before
    durable.resume_queue(queue)
    with durable.db.begin() as conn:
        assert queries.claim_run(durable.db, conn, run_id, 0, "w:1:1").id == run_id


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


def test_a_claim_takes_the_lock_and_resets_the_relay_marks(durable):
    steps = Steps(durable, fail_first=True)
    run_id = durable.start(steps.wf)
    set_run(durable, run_id, resends=3, resend_at=durable.db.utcnow(), published=True, due_at=ago(durable, 1))
    assert steps.run(run_id, 0) == "retrying"
    claimed = steps.rows[0]
    assert (claimed.status, claimed.fence, claimed.resends, claimed.resend_at) == ("running", 1, 0, None)
    assert (claimed.published, claimed.due_at) == (False, None)
    assert claimed.locked_by is not None and claimed.heartbeat_at is not None
    assert claimed.started_at is not None and claimed.deadline_at is None
    after = run_row(durable, run_id)  # the failed attempt's record: unlocked, attempt 2 due later
    assert (after.locked_by, after.heartbeat_at, after.attempt, after.published) == (None, None, 2, False)

    set_run(durable, run_id, due_at=ago(durable, 1))
    assert steps.run(run_id, 0) == "running"
    again = steps.rows[1]
    assert (again.fence, again.attempt) == (2, 2)
    assert again.started_at == claimed.started_at  # the first claim's, kept
    moved_on = run_row(durable, run_id)
    assert (moved_on.step_index, moved_on.attempt, moved_on.published) == (1, 1, True)
    assert (moved_on.locked_by, moved_on.heartbeat_at) == (None, None)


def test_a_compensation_claim_keeps_the_run_compensating(durable):
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    set_run(durable, run_id, status="compensating", due_at=ago(durable, 1), fence=2)
    with durable.db.begin() as conn:
        assert queries.claim_run(durable.db, conn, run_id, 0, "w:1:1") is None  # not a step's claim
        claimed = queries.claim_run(durable.db, conn, run_id, 0, "w:1:1", compensate=True)
    assert claimed.id == run_id
    row = run_row(durable, run_id)
    assert (row.status, row.fence, row.locked_by, row.due_at) == ("compensating", 3, "w:1:1", None)


def test_a_workflow_timeout_counts_from_the_first_claim_when_not_set_at_start(durable):
    steps = Steps(durable, timeout=600, fail_first=True)
    run_id = durable.start(steps.wf)
    set_run(durable, run_id, deadline_at=None)  # as for a debounced or run_again run
    steps.run(run_id, 0)
    deadline = steps.rows[0].deadline_at
    expected = steps.rows[0].heartbeat_at + timedelta(seconds=600)
    assert abs((deadline - expected).total_seconds()) < 5
    set_run(durable, run_id, due_at=ago(durable, 1))
    steps.run(run_id, 0)
    assert steps.rows[1].deadline_at == deadline  # kept, not moved by the next claim


def test_claims_with_and_without_a_timeout_each_keep_their_own_statement(durable):
    steps = Steps(durable)
    plain, timed = start_runs(durable, steps, 2)
    set_run(durable, timed, deadline_at=None)
    with durable.db.begin() as conn:  # the claim without a timeout is built (and cached) first
        assert queries.claim_run(durable.db, conn, plain, 0, "w:1:1").id == plain
        assert queries.claim_run(durable.db, conn, timed, 0, "w:1:1", timeout=600).id == timed
    assert run_row(durable, plain).deadline_at is None
    assert run_row(durable, timed).deadline_at is not None  # counted from this first claim


def test_a_claim_by_a_build_without_the_workflow_timeout_keeps_the_runs_deadline(make_durable):
    """A run started where its workflow had a timeout keeps its deadline when a worker of a
    build that dropped the timeout (a rolling deploy) claims it: the claim leaves it alone."""
    timed = Steps(make_durable("timed"), timeout=600)
    run_id = timed.durable.start(timed.wf)
    deadline = run_row(timed.durable, run_id).deadline_at
    assert deadline is not None
    untimed = Steps(make_durable("untimed"))
    untimed.run(run_id, 0)
    assert len(untimed.rows) == 1  # claimed and ran
    assert untimed.rows[0].deadline_at == deadline  # as the step saw its claimed run
    assert run_row(untimed.durable, run_id).deadline_at == deadline


# -- a held run, moved only under its fence ------------------------------------------------------


def test_a_hand_back_frees_the_run_for_the_relay_later_only_under_its_fence(durable):
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    held = {"status": "running", "fence": 3, "locked_by": "w:1:1", "heartbeat_at": ago(durable, 1)}
    set_run(durable, run_id, published=True, **held)
    with durable.db.begin() as conn:
        assert queries.hand_back_txn(durable.db, conn, run_id, 2, "w:1:1", 30) is False  # fenced out
    assert (run_row(durable, run_id).locked_by, run_row(durable, run_id).published) == ("w:1:1", True)
    before = durable.db.utcnow()
    with durable.db.begin() as conn:
        assert queries.hand_back_txn(durable.db, conn, run_id, 3, "w:2:1", 30) is False  # not its holder
        assert queries.hand_back_txn(durable.db, conn, run_id, 3, "w:1:1", 30) is True
    row = run_row(durable, run_id)
    assert (row.status, row.fence, row.attempt) == ("running", 3, 1)  # the same attempt, unrecorded
    assert (row.locked_by, row.heartbeat_at, row.published) == (None, None, False)  # the relay sends it
    due = row.due_at if row.due_at.tzinfo else row.due_at.replace(tzinfo=before.tzinfo)
    assert timedelta(seconds=29) <= due - before <= timedelta(seconds=40)


def test_a_heartbeat_moves_the_lock_s_time_forward_only_under_its_fence(durable):
    steps = Steps(durable)
    run_id = durable.start(steps.wf)
    old = ago(durable, 120)
    set_run(durable, run_id, status="running", fence=4, locked_by="w:1:1", heartbeat_at=old)
    with durable.db.begin() as conn:
        assert queries.heartbeat_run(durable.db, conn, run_id, 3, "w:1:1") is False  # fenced out
        assert queries.heartbeat_run(durable.db, conn, run_id, 4, "w:2:1") is False  # not its holder
    before = run_row(durable, run_id).heartbeat_at  # untouched by the fenced-out beat
    with durable.db.begin() as conn:
        assert queries.heartbeat_run(durable.db, conn, run_id, 4, "w:1:1") is True
    after = run_row(durable, run_id).heartbeat_at
    assert after is not None and after - before >= timedelta(seconds=119)


@pytest.mark.parametrize("action", ["defer", "fail"])
def test_a_run_without_its_code_here_is_deferred_or_failed_only_if_unclaimed_at_that_step(durable, action):
    steps = Steps(durable)
    run_id, bystander, locked, moved_on, finished = start_runs(durable, steps, 5)
    for r in (run_id, bystander, locked, moved_on, finished):
        set_run(durable, r, step_index=1, published=True, due_at=ago(durable, 1))
    set_run(durable, locked, status="running", locked_by="w:1:1")
    set_run(durable, moved_on, step_index=2)
    set_run(durable, finished, status="completed")
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
    row = run_row(durable, run_id)
    if action == "defer":
        assert (row.status, row.published, row.error, row.finished_at) == ("pending", False, None, None)
        due = row.due_at if row.due_at.tzinfo else row.due_at.replace(tzinfo=before.tzinfo)
        assert timedelta(seconds=29) <= due - before <= timedelta(seconds=40)
    else:
        assert (row.status, row.published, row.error, row.due_at) == ("failed", False, error, None)
        assert row.finished_at is not None
    untouched = run_row(durable, bystander)
    assert (untouched.status, untouched.published, untouched.due_at is not None) == ("pending", True, True)


def test_records_with_and_without_a_continuation_each_keep_their_own_statement(durable):
    """The same run values recorded without, then with, an inline continuation: each record
    has its statement (the second claims the next step and returns the claim's columns)."""
    steps = Steps(durable)
    first, second = start_runs(durable, steps, 2)
    values = {"status": "running", "step_index": 1, "step_name": "second"}

    def step_row(run_id: str) -> dict[str, Any]:
        now = durable.db.utcnow()
        return {
            "step_index": 0,
            "phase": "step",
            "name": "first",
            "attempt": 1,
            "status": "completed",
            "started_at": now,
            "finished_at": now,
        }

    rows = []
    with durable.db.begin() as conn:  # the record without a continuation is built (and cached) first
        for run_id, go_on in ((first, None), (second, queries.GoOn("w:1:1", "celery"))):
            held = queries.claim_run(durable.db, conn, run_id, 0, "w:1:1")
            rows.append(
                queries.record_step_txn(
                    durable.db, conn, run_id, held.fence, held.locked_by, values, step_row(run_id), go_on
                )
            )
    assert rows[0] is not None and rows[1].locked_by == "w:1:1" and rows[1].step_name == "second"
    assert run_row(durable, first).locked_by is None  # recorded, left for the next message
    assert run_row(durable, second).locked_by == "w:1:1"  # recorded, and its next step claimed
