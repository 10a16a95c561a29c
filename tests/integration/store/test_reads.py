"""The readers, exactly: ``run_held_by``, ``step_recorded``, ``pending_inputs`` and
``count_runs_by_status`` called directly (the statements the engine, rollout and the dashboard
read), and ``list_runs``, ``list_pending_inputs``, ``list_steps`` and ``fetch_run`` through the
API: their filters, order, limits and locks.

On both backends; rows are put in the state a case needs by writing them directly. Written
against mutants of durable_celery/store/queries.py that the behaviour tests let through."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from durable_celery import current_run
from durable_celery.errors import InvalidArgument, RunNotFound
from durable_celery.store import queries
from durable_celery.store.schema import runs
from durable_celery.store.schema import steps as step_rows
from tests.integration.helpers import Steps, ago, one_step, set_run, start_runs

pytestmark = pytest.mark.timeout(60)


def test_run_held_by_finds_a_run_only_under_its_holder_s_node_prefix(durable):
    steps = Steps(durable)
    mine, compensating, other_node, wildcard, unlocked, finished = start_runs(durable, steps, 6)
    beat = ago(durable, 1)
    set_run(durable, mine, status="running", locked_by="w_1:9", heartbeat_at=beat)
    set_run(durable, compensating, status="compensating", locked_by="w_1:7", heartbeat_at=beat)
    set_run(durable, other_node, status="running", locked_by="w_12:9", heartbeat_at=beat)
    set_run(durable, wildcard, status="running", locked_by="wx1:9", heartbeat_at=beat)  # `_` is literal
    set_run(durable, finished, status="completed", locked_by="w_1:9")
    with durable.db.engine.connect() as conn:
        held = queries.run_held_by(conn, mine, "w_1:")
        assert (held.id, held.workflow, held.status, held.locked_by) == (mine, "claimed", "running", "w_1:9")
        assert held.heartbeat_at is not None and held.fence == 0
        assert queries.run_held_by(conn, compensating, "w_1:").status == "compensating"
        for run_id in (other_node, wildcard, unlocked, finished):
            assert queries.run_held_by(conn, run_id, "w_1:") is None


def test_step_recorded_matches_the_run_step_phase_attempt_and_worker_exactly(durable):
    steps = Steps(durable)
    run_id, other = start_runs(durable, steps, 2)
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
    set_run(durable, older, status="waiting", wait_name="in_put:a", wait_until=until)
    set_run(durable, older, created_at=ago(durable, 9))
    set_run(durable, newer, status="waiting", wait_name="in_put:b", created_at=ago(durable, 5))
    set_run(durable, lookalike, status="waiting", wait_name="inXput:c")  # `_` is literal
    set_run(durable, running, status="running", wait_name="in_put:d")
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
    a, b, c = start_runs(durable, steps, 3)
    set_run(durable, c, status="completed")
    other = durable.workflow("other")
    other.step(lambda: None, name="only")
    durable.start(other)
    with durable.db.engine.connect() as conn:
        assert queries.count_runs_by_status(conn) == {
            ("claimed", "pending"): 2,
            ("claimed", "completed"): 1,
            ("other", "pending"): 1,
        }


# -- through the API ----------------------------------------------------------------------------


def test_list_runs_filters_by_workflow_key_and_status_newest_first(durable):
    a, b = one_step(durable, "a_flow"), one_step(durable, "b_flow")
    ids = [durable.start(a), durable.start(b), durable.start(a, key="k1"), durable.start(b)]
    set_run(durable, ids[1], status="failed")
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
    # Newest by the time-ordered id (the start order, the primary key's: no sort of every run),
    # whatever created_at says.
    set_run(durable, ids[0], created_at=durable.db.utcnow() + timedelta(hours=1))
    same = durable.db.utcnow() - timedelta(hours=1)
    set_run(durable, ids[1], created_at=same)
    set_run(durable, ids[3], created_at=same)
    assert listed() == newest
    # Pages: after= the last run of a page gives the next one, to the end.
    assert listed(limit=2, after=newest[1]) == newest[2:]
    assert listed(workflow="a_flow", after=ids[2]) == [ids[0]]
    assert listed(after=ids[0]) == []
    with pytest.raises(InvalidArgument):
        durable.list_runs(after=42)


def test_pending_inputs_of_one_workflow_oldest_first_not_cut_by_others(durable):
    """Guards a past bug: ``list_pending_inputs(workflow=)`` filtered after the limit, so
    older waits of other workflows could hide every one of the workflow asked for."""
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
    set_run(durable, waiting[2], created_at=old)  # the older of the two asks
    set_run(durable, waiting[0], created_at=old - timedelta(hours=1))  # the oldest of all: another's
    assert [p.run_id for p in durable.list_pending_inputs(workflow="asks")] == [waiting[2], waiting[1]]
    assert [p.run_id for p in durable.list_pending_inputs(workflow="asks", limit=1)] == [waiting[2]]
    assert [p.run_id for p in durable.list_pending_inputs(limit=1)] == [waiting[0]]
    everyone = [p.run_id for p in durable.list_pending_inputs()]
    assert everyone == [waiting[0], waiting[2], waiting[1], waiting[3]]


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


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite: one writer at a time, no row locks
def test_fetch_run_waits_for_the_row_lock_only_when_it_locks(durable):
    """``fetch_run(lock=True)`` (the cancel's read) waits for a transaction holding the run's row;
    a plain read does not."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    one_step(durable, "shipped")
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


def test_activity_goes_page_by_page_with_after(durable):
    flow = one_step(durable, "noted_flow")
    holder = durable.start(flow, key="k")
    for _ in range(3):
        assert durable.start(flow, key="k") == holder  # each a key_duplicate entry
    every = [a.id for a in durable.activity(kinds="key_duplicate")]
    assert len(every) == 3 and every == sorted(every, reverse=True)
    first = durable.activity(kinds="key_duplicate", limit=2)
    rest = durable.activity(kinds="key_duplicate", limit=2, after=first[-1].id)
    assert [a.id for a in first + rest] == every
    with pytest.raises(InvalidArgument):
        durable.activity(after="x")


def test_steps_go_page_by_page_with_after(durable):
    wf = durable.workflow("five_steps")
    for n in range(5):
        wf.step(lambda n=n: n, name=f"s{n}")
    run_id = durable.start(wf)
    for index in range(5):
        durable.run_message("five_steps", index, run_id)
    every = durable.list_steps(run_id)
    assert [s.name for s in every] == [f"s{n}" for n in range(5)]
    ids = [s.id for s in every]
    assert all(isinstance(i, int) for i in ids) and ids == sorted(ids)
    pages, page = [], durable.list_steps(run_id, 2)
    while page:
        assert len(page) <= 2
        pages.append([s.name for s in page])
        page = durable.list_steps(run_id, 2, after=page[-1].id)
    assert pages == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert durable.list_steps(run_id, after=ids[2]) == every[3:]
    assert durable.list_steps(run_id, limit=1, after=ids[-1]) == []
    for bad in ({"after": "x"}, {"after": 0}, {"limit": 0}, {"limit": "2"}):
        with pytest.raises(InvalidArgument):
            durable.list_steps(run_id, **bad)
    with pytest.raises(RunNotFound):
        durable.list_steps("no-such-run", 2)
