"""A worker that lost its run records nothing: fenced out by a takeover (the run's fence moved
on) or stopped by a cancel, whether it notices at a heartbeat, a snooze, a wait or its record;
each fenced worker is counted, signalled and logged, and its end settles no key.

The first test runs real worker threads, ordered by events; the others run steps through
``run_message``, as a worker runs a message, in the test's thread, on both backends (written
against mutants of durable_celery/core/engine.py that the behaviour tests let through)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import select

from durable_celery import current_run, signals
from durable_celery.errors import RunStopped
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for, worker
from tests.integration.core.helpers import take_over_run, undo_flow
from tests.integration.helpers import run_row

pytestmark = pytest.mark.timeout(60)


WAIT = 15.0  # seconds any one event may take, on a loaded machine


def _wait(event: threading.Event, what: str) -> None:
    if not event.wait(WAIT):
        raise AssertionError(f"timed out waiting for {what}")


# -- the stale worker wakes while the new holder is mid-step ----------------------------------


class TakeOver:
    """One step run twice at once: the first (stale) execution blocks until released; the sweep
    hands the run to a second execution, which blocks inside the step until released too."""

    def __init__(self, durable: Any, action: str) -> None:
        self.durable = durable
        self.action = action
        self.stale_inside = threading.Event()
        self.new_inside = threading.Event()
        self.release_stale = threading.Event()
        self.release_new = threading.Event()
        self.stale_done = threading.Event()  # the stale execution's outcome is settled
        self.seen: list[str] = []  # what the stale execution went through
        self.calls = 0
        self.lock = threading.Lock()
        self.run_id = ""

    def step(self) -> str:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            return self._stale()
        return self._new()

    def _stale(self) -> str:
        self.stale_inside.set()
        # Blocks without a heartbeat (heartbeat_interval is long): its lock goes stale.
        _wait(self.release_stale, "the test to wake the stale worker")
        run = current_run()
        try:
            if self.action == "raises":
                raise ValueError("the stale worker's failure")
            if self.action == "heartbeats":
                run.heartbeat()
            elif self.action == "snoozes":
                run.snooze(30, "stale")
            elif self.action == "waits":
                run.wait_for_event("never")
        except RunStopped as exc:
            self.seen.append(f"stopped:{exc.reason}")
            raise
        self.seen.append("went on")
        return "stale worker"

    def _new(self) -> str:
        self.new_inside.set()
        while not self.release_new.wait(0.05):
            current_run().heartbeat()  # the new holder keeps its own lock fresh meanwhile
        return "new worker"

    def on_fenced(self, sender: Any, run_id: str, **kw: Any) -> None:
        if run_id == self.run_id:
            self.seen.append("fenced")
            self.stale_done.set()


@contextmanager
def take_over(make_durable: Any, action: str) -> Iterator[TakeOver]:
    # No heartbeats unless a step asks for one, and a lock stale after half a second: the sweep
    # of the worker's own upkeep hands the run to the worker's second thread.
    durable = make_durable(heartbeat_interval=60, stale_lock_timeout=0.5, sweep_interval=0.1)
    scene = TakeOver(durable, action)
    wf = durable.workflow("taken_over")
    wf.step(retry=3)(scene.step)
    signals.worker_fenced.connect(scene.on_fenced, weak=False)
    try:
        with worker(durable, concurrency=2):
            scene.run_id = durable.start(wf)
            try:
                yield scene
            finally:  # let both executions end whatever the test saw
                scene.release_stale.set()
                scene.release_new.set()
    finally:
        signals.worker_fenced.disconnect(scene.on_fenced)


def _locked_by(durable: Any, run_id: str) -> tuple[str | None, int]:
    with durable.db.engine.connect() as conn:
        row = conn.execute(select(runs.c.locked_by, runs.c.fence).where(runs.c.id == run_id)).one()
    return row.locked_by, row.fence


@pytest.mark.parametrize("action", ["returns", "raises", "heartbeats", "snoozes", "waits"])
def test_stale_worker_waking_while_the_new_holder_is_mid_step_is_fenced_out(make_durable, action):
    """Guards issue 16 (a deliberate one-line break used to slip past): a worker whose lock went
    stale wakes up (returns, fails, heartbeats, snoozes or waits) while the worker that took the
    run over is still running the same step. The run's status is ``running`` then, so only the
    fencing token can refuse the stale worker: it records nothing, is stopped, and the new
    holder's result is the run's. (When the new holder has already finished, the status check
    refuses the stale worker too, which is all the older tests looked at.) Real worker threads;
    events order everything."""
    with take_over(make_durable, action) as scene:
        durable = scene.durable
        _wait(scene.stale_inside, "the first execution to start")
        _wait(scene.new_inside, "the sweep to hand the run to the second execution")
        holder_before = _locked_by(durable, scene.run_id)
        assert durable.get_run(scene.run_id).status == "running"

        scene.release_stale.set()
        _wait(scene.stale_done, f"the stale worker ({action}) to be fenced out")

        # It recorded nothing and changed nothing: the new holder still has the run.
        assert durable.list_steps(scene.run_id) == []
        assert _locked_by(durable, scene.run_id) == holder_before
        run = durable.get_run(scene.run_id)
        assert (run.status, run.attempt, run.error) == ("running", 1, None)
        if action == "heartbeats":  # stopped at its heartbeat, inside the step
            assert scene.seen == ["stopped:fenced", "fenced"]
        elif action in ("returns", "raises"):
            assert scene.seen == (["went on", "fenced"] if action == "returns" else ["fenced"])
        kinds = [a.kind for a in durable.activity(run_id=scene.run_id)]
        assert "worker_fenced" in kinds and "snoozed" not in kinds

        scene.release_new.set()
        run = wait_for(durable, scene.run_id, timeout=WAIT)
    assert (run.status, run.output, run.attempt) == ("completed", "new worker", 1)
    steps = durable.list_steps(scene.run_id)
    assert [(s.status, s.output, s.attempt) for s in steps] == [("completed", "new worker", 1)]
    assert scene.calls == 2


# -- a takeover or a cancel met at a snooze, a wait, the record ------------------------------


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
def test_a_step_whose_run_was_taken_before_its_record_records_nothing_and_says_why(make_durable, how):
    """The step returned, but the run was taken over or cancelled before its record (no beat in
    between to stop it): the record is refused, and the message's result tells which."""
    durable = make_durable(heartbeat_interval=30, stale_lock_timeout=120)
    wf = durable.workflow("taken_at_the_end")

    @wf.step
    def only():
        take_over_run(durable, current_run().id, how)
        return "done"

    run_id = durable.start(wf)
    assert durable.run_message("taken_at_the_end", 0, run_id) == how
    assert durable.list_steps(run_id) == []
    entries = durable.activity(kinds=["worker_fenced"], run_id=run_id)
    assert (durable.engine.fenced_count, len(entries)) == ((1, 1) if how == "fenced" else (0, 0))


def test_each_fenced_worker_is_counted_signalled_and_logged_with_the_runs_key(durable):
    wf = durable.workflow("fenced_twice")

    @wf.step
    def only():
        take_over_run(durable, current_run().id, "fenced")
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


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
@pytest.mark.parametrize("phase", ["step", "compensation"])
def test_a_snooze_of_a_run_taken_meanwhile_is_not_handed_back(durable, how, phase):
    def nap():
        take_over_run(durable, current_run().id, how)
        current_run().snooze(5, reason="later")

    if phase == "step":
        wf = durable.workflow("napping")
        wf.step(nap, name="nap")
        run_id = durable.start(wf)
        status = durable.run_message("napping", 0, run_id)
    else:
        _, run_id = undo_flow(durable, nap)
        status = durable.run_message("undoing", 0, run_id, compensate=True)
    assert status == how
    assert durable.activity(kinds=["snoozed"], run_id=run_id) == []
    row = run_row(durable, run_id)
    held = "running" if phase == "step" else "compensating"
    assert row.status == ("cancelled" if how == "cancelled" else held)
    assert row.locked_by is not None  # not handed back: left as the takeover left it


def test_a_wait_of_a_run_cancelled_meanwhile_is_not_parked(durable):
    wf = durable.workflow("cancelled_wait")

    @wf.step
    def wait():
        take_over_run(durable, current_run().id, "cancelled")
        return current_run().wait_for_event("paid", timeout=60)

    run_id = durable.start(wf)
    assert durable.run_message("cancelled_wait", 0, run_id) == "cancelled"
    row = run_row(durable, run_id)
    assert (row.status, row.wait_name) == ("cancelled", None)
    assert durable.activity(kinds=["worker_fenced"], run_id=run_id) == []


def test_a_fenced_holders_end_leaves_the_run_waiting_behind_it_waiting(durable):
    wf = durable.workflow("fenced_holder", on_duplicate="run_again")
    wf.step(lambda: 1, name="first")

    @wf.step
    def second():
        take_over_run(durable, current_run().id, "fenced")  # another worker has the run now

    holder = durable.start(wf, key="k")
    assert durable.run_message("fenced_holder", 0, holder) == "running"
    behind = durable.start(wf, key="k")
    assert durable.run_message("fenced_holder", 1, holder) == "fenced"
    assert durable.get_run(behind).status == "waiting"  # the holder has not ended
    assert durable.get_run(holder).status == "running"
    assert durable.activity(kinds=["key_handed_off"]) == []
