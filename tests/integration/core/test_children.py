"""Child workflows and parallel branches: started once, waited for without a worker slot."""

from __future__ import annotations

import threading

import pytest

from durable_celery import ChildFailed, InvalidArgument, current_run
from durable_celery.testing import wait_for, worker
from tests.conftest import EVERY_STORE

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=EVERY_STORE)
def backend(request: pytest.FixtureRequest) -> str:
    """PostgreSQL, the embedded SQLite default, and the in-memory store."""
    return str(request.param)


def test_call_workflow_waits_for_the_child_and_never_starts_a_second_one(durable):
    started: list[str] = []
    child = durable.workflow("invoice", key="invoice:{order}")

    @child.step
    def make_invoice(order):
        started.append(current_run().id)
        current_run().sleep(0.3)  # the parent waits meanwhile without a worker
        return f"INV-{order}"

    parent = durable.workflow("checkout")

    @parent.step
    def bill(order):
        invoice = current_run().call_workflow(child, {"order": order})
        current_run().context["invoice"] = invoice
        return invoice

    @parent.step
    def done(order):
        return current_run().context["invoice"]

    with worker(durable, concurrency=1):  # one slot: the parent must not hold it while waiting
        run_id = durable.start(parent, {"order": 7}, key="checkout:7")
        run = wait_for(durable, run_id)
    assert run.status == "completed" and run.output == "INV-7"
    children = durable.list_children(run_id)
    assert len(children) == 1 and len(set(started)) == 1
    kid = children[0]
    assert kid.parent_id == run_id and kid.workflow == "invoice"
    assert kid.key == "invoice:7"  # its own key, from its own template; not the parent's
    assert kid.status == "completed"


def test_a_failed_child_raises_in_the_parent_and_a_retry_starts_a_fresh_child(durable):
    calls = {"n": 0}
    flaky = durable.workflow("flaky")

    @flaky.step
    def work():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("first child fails")
        return "ok"

    parent = durable.workflow("parent")
    seen: list[str] = []

    @parent.step(retry=2)
    def call():
        try:
            return current_run().call_workflow("flaky")
        except ChildFailed as exc:
            seen.append(exc.status)
            raise

    with worker(durable):
        run = wait_for(durable, durable.start(parent))
    assert run.status == "completed" and run.output == "ok"
    assert seen == ["failed"]
    assert [c.status for c in durable.list_children(run.id)] == ["failed", "completed"]


def test_start_workflow_is_fire_and_forget_and_replays_return_the_same_child(durable):
    child = durable.workflow("email")

    @child.step
    def send(to):
        return f"sent to {to}"

    ids: list[str] = []
    parent = durable.workflow("signup")

    @parent.step
    def welcome(user):
        ids.append(current_run().start_workflow(child, {"to": user}))
        current_run().sleep(0.2)  # the step runs again after this: same child id
        return ids[-1]

    with worker(durable):
        run = wait_for(durable, durable.start(parent, {"user": "ada"}))
        kid = wait_for(durable, run.output)
    assert len(ids) == 2 and ids[0] == ids[1] == kid.id
    assert kid.output == "sent to ada" and kid.parent_id == run.id


def _parent_of_two_waiting_children(durable, name):
    """A workflow whose one step runs two branches that wait for an event nobody sends."""
    child = durable.workflow(f"{name}_child")

    @child.step
    def wait_forever():
        current_run().wait_for_event("never")

    parent = durable.workflow(f"{name}_parent")

    @parent.step
    def spawn():
        current_run().parallel([(child, None), (child, None)])

    return parent


def test_cancelling_a_parent_cancels_its_unfinished_children(durable):
    parent = _parent_of_two_waiting_children(durable, "long")
    with worker(durable):
        run_id = durable.start(parent)

        def all_waiting():
            kids = durable.list_children(run_id)
            parent = durable.get_run(run_id)
            # A parent that parks while a child's row is locked (the child being claimed) is
            # made due at once and parks again: it may be running for a moment.
            return len(kids) == 2 and all(k.status == "waiting" for k in kids) and parent.status == "waiting"

        _until(all_waiting)
        assert durable.cancel(run_id) is True
    assert durable.get_run(run_id).status == "cancelled"
    assert [k.status for k in durable.list_children(run_id)] == ["cancelled", "cancelled"]


def test_parallel_step_group_runs_branches_at_once_and_collects_results(durable):
    inside = threading.Barrier(3, timeout=20)  # all three branches must be running together
    wf = durable.workflow("fulfil")

    @wf.step
    def prepare(order):
        current_run().context["total"] = 30

    def charge(order):
        inside.wait()
        return {"charged": current_run().context["total"]}

    def pack(order):
        inside.wait()
        return f"box-{order}"

    def label(order):
        inside.wait()
        return "label"

    wf.parallel(charge, pack, label)

    @wf.step
    def ship(order):
        ctx = current_run().context
        return [ctx["charge"], ctx["pack"], ctx["label"]]

    with worker(durable, concurrency=4):
        run = wait_for(durable, durable.start(wf, {"order": 5}, key="fulfil:5"))
    assert run.status == "completed"
    assert run.output == [{"charged": 30}, "box-5", "label"]
    branches = durable.list_children(run.id)
    assert sorted(b.workflow for b in branches) == ["fulfil.charge", "fulfil.label", "fulfil.pack"]
    assert all(b.key is None and b.parent_id == run.id for b in branches)  # keys not inherited


def test_parallel_fail_fast_cancels_the_other_branches(durable):
    wf = durable.workflow("fanout")

    def fails():
        raise RuntimeError("branch broke")

    def waits():
        current_run().wait_for_event("never")

    wf.parallel(fails, waits, fail_fast=True)

    with worker(durable):
        run = wait_for(durable, durable.start(wf))
    assert run.status == "failed"
    assert "branch broke" in run.error["message"]
    statuses = {b.workflow: b.status for b in durable.list_children(run.id)}
    assert statuses == {"fanout.fails": "failed", "fanout.waits": "cancelled"}


def test_parallel_without_fail_fast_waits_for_every_branch(durable):
    wf = durable.workflow("patient")

    def fails():
        raise RuntimeError("broke")

    def slow():
        current_run().sleep(0.5)
        return "slow done"

    wf.parallel(fails, slow, fail_fast=False)

    with worker(durable):
        run = wait_for(durable, durable.start(wf))
    assert run.status == "failed"
    statuses = {b.workflow: b.status for b in durable.list_children(run.id)}
    assert statuses == {"patient.fails": "failed", "patient.slow": "completed"}


def test_parallel_from_a_step_returns_outputs_in_shape(durable):
    square = durable.workflow("square")

    @square.step
    def sq(x):
        return x * x

    wf = durable.workflow("sums")

    @wf.step
    def total():
        as_list = current_run().parallel([(square, {"x": n}) for n in range(4)])
        as_dict = current_run().parallel({"a": (square, {"x": 5}), "b": ("square", {"x": 6})})
        return [as_list, as_dict]

    with worker(durable, concurrency=3):
        run = wait_for(durable, durable.start(wf))
    assert run.output == [[0, 1, 4, 9], {"a": 25, "b": 36}]
    assert len(durable.list_children(run.id)) == 6


def test_bad_branches_are_refused(durable):
    wf = durable.workflow("bad_branches")
    errors: list[str] = []

    @wf.step
    def go():
        for calls in ([], [("x",)], {"a": 3}):
            try:
                current_run().parallel(calls)
            except InvalidArgument as exc:
                errors.append(type(exc).__name__)

    with worker(durable):
        run = wait_for(durable, durable.start(wf))
    assert run.status == "completed" and errors == ["InvalidArgument"] * 3
    assert durable.list_children(run.id) == []


def _until(condition, seconds: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_cli_show_lists_compensations_and_children(durable, tmp_path):
    import os
    import subprocess
    import sys
    import textwrap

    wf = durable.workflow("shown")

    def undo_a():
        pass

    @wf.step(compensate=undo_a)
    def a():
        current_run().start_workflow("shown_child")

    @wf.step
    def b():
        raise RuntimeError("b broke")

    child = durable.workflow("shown_child")
    child.step(lambda: "kid", name="kid")

    with worker(durable):
        run = wait_for(durable, durable.start(wf))
    assert run.status == "compensated"
    (tmp_path / "showapp.py").write_text(
        textwrap.dedent(f"""
        from celery import Celery
        from durable_celery import Durable
        app = Celery("showapp", broker="memory://")
        durable = Durable(app, {durable.db.url!r}, upkeep=False)
        """)
    )
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "showapp", "durable", "show", run.id],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "0. compensation of a attempt 1: completed" in out.stdout
    assert "1. b attempt 1: failed b broke" in out.stdout
    kid = durable.list_children(run.id)[0]
    assert f"child {kid.id} (shown_child)" in out.stdout


def test_many_parents_whose_children_finish_while_they_park_all_complete(durable):
    """Children that finish at the moment their parent parks: no wake-up is lost and no
    transaction deadlocks (the parent never waits on a finishing child's row)."""
    quick = durable.workflow("instant")
    quick.step(lambda n: n, name="echo")
    parent = durable.workflow("fan_in")

    @parent.step
    def gather(p):
        return sum(current_run().parallel([(quick, {"n": p * 10 + i}) for i in range(8)]))

    with worker(durable, concurrency=8):
        ids = [durable.start(parent, {"p": p}) for p in range(40)]
        runs = [wait_for(durable, run_id, timeout=60) for run_id in ids]
    assert [r.status for r in runs] == ["completed"] * 40
    assert [r.output for r in runs] == [sum(p * 10 + i for i in range(8)) for p in range(40)]


def test_a_step_of_a_cancelled_run_cannot_start_children(make_durable):
    # The heartbeat is slow here, so the step is still running when it starts its child: the
    # child's transaction sees the cancel and refuses, and nothing is left behind.
    durable = make_durable(heartbeat_interval=60.0, stale_lock_timeout=300.0)
    child = durable.workflow("late_child")
    child.step(lambda: "ran", name="only")
    parent = durable.workflow("late_parent")
    started, go, raised = threading.Event(), threading.Event(), []

    @parent.step
    def spawn():
        started.set()
        go.wait(20)
        try:
            current_run().start_workflow(child)
        except BaseException as exc:
            raised.append(type(exc).__name__)
            raise

    with worker(durable):
        run_id = durable.start(parent)
        assert started.wait(20)
        assert durable.cancel(run_id) is True
        go.set()
        _until(lambda: raised or durable.list_children(run_id))
    assert raised == ["StepCancelled"]
    assert durable.list_children(run_id) == []
    assert durable.get_run(run_id).status == "cancelled"
    assert [r.workflow for r in durable.list_runs(workflow="late_child")] == []


@pytest.mark.parametrize("backend", ["postgres"])
def test_children_of_a_cancel_cut_short_are_found_and_cancelled(make_durable):
    from sqlalchemy import update

    from durable_celery.store.schema import runs

    durable = make_durable(sweep_interval=0.5)
    parent = _parent_of_two_waiting_children(durable, "orphan")
    with worker(durable):
        run_id = durable.start(parent)
        _until(lambda: [k.status for k in durable.list_children(run_id)] == ["waiting", "waiting"])
    # What a cancel leaves when its process dies after the parent's transaction committed.
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(status="cancelled"))
    kids = {k.id for k in durable.list_children(run_id)}
    found = [f for f in durable.doctor() if f.kind == "orphaned_child"]
    assert {f.run_id for f in found} == kids and all(f.fixable for f in found)
    assert {f.details["parent_id"] for f in found} == {run_id}

    # A worker's upkeep cancels them (the same repair ``doctor --fix`` runs).
    with worker(durable):
        _until(lambda: [k.status for k in durable.list_children(run_id)] == ["cancelled", "cancelled"])
    assert [f for f in durable.doctor() if f.kind == "orphaned_child"] == []


def test_a_parent_replaced_by_cancel_existing_takes_its_children_with_it(durable):
    child = durable.workflow("replaced_child")

    @child.step
    def wait_forever():
        current_run().wait_for_event("never")

    parent = durable.workflow("replaced_parent", key="sync:{account}", on_duplicate="cancel_existing")

    @parent.step
    def spawn(account):
        current_run().call_workflow(child)

    with worker(durable):
        first = durable.start(parent, {"account": 7})
        _until(lambda: [k.status for k in durable.list_children(first)] == ["waiting"])
        second = durable.start(parent, {"account": 7})
        assert second != first and durable.get_run(first).status == "cancelled"
        # At once, not at the upkeep's orphan sweep (sweep_interval is 60 s here).
        assert [k.status for k in durable.list_children(first)] == ["cancelled"]
        _until(lambda: [k.status for k in durable.list_children(second)] == ["waiting"])
        assert durable.cancel(second) is True
    assert [k.status for k in durable.list_children(second)] == ["cancelled"]
