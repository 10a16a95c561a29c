"""A parent and its children as the engine records them: a parent whose child finished before
it parked is due at once; each step of a parent starts a child of its own that names the
parent; a keyed child's end sends the run behind its key and wakes its parent at once, a fenced
child's end wakes nothing. With real workers: tests/integration/core/test_children.py.

Steps run through ``run_message``, as a worker runs a message, in the test's thread, on both
backends. Written against mutants of durable_celery/core/engine.py that the behaviour tests
let through."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, update

from durable_celery import current_run
from durable_celery.store.child_rows import CHILDREN_WAIT
from durable_celery.store.schema import runs
from tests.integration.core.helpers import take_over_run
from tests.integration.helpers import run_row

pytestmark = pytest.mark.timeout(60)


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
            take_over_run(durable, run_id, "fenced")
        return real_park(engine, *args, **kwargs)

    monkeypatch.setattr(type(durable.engine), "_park", child_first)
    status = durable.run_message("parent", 0, run_id)
    row = run_row(durable, run_id)
    if taken:  # the park was refused: the run is left as the takeover left it
        assert status == "fenced"
        assert (row.status, row.due_at) == ("running", None)  # as the claim left it: not made due
        return
    assert status == "waiting"
    assert row.status == "waiting" and row.due_at is not None  # due again: the child is done
    monkeypatch.setattr(type(durable.engine), "_park", real_park)
    assert durable.run_message("parent", 0, run_id) == "completed"
    assert durable.get_run(run_id).output == 40


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
    assert run_row(durable, parent).due_at is not None


def test_a_fenced_childs_end_does_not_wake_its_parent(durable):
    wf = durable.workflow("kid_fenced")

    @wf.step
    def only():
        take_over_run(durable, current_run().id, "fenced")

    parent, child = durable.start(wf), durable.start(wf)
    _waits_for_child(durable, parent, child)
    assert durable.run_message("kid_fenced", 0, child) == "fenced"
    assert run_row(durable, parent).due_at is None
