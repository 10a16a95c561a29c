"""A graceful shutdown: a step still running when the grace period ends is handed back
without using an attempt (its entry names the key and keeps the lines logged); a hand-back that
finds the run taken records nothing; a compensation runs on past the grace period; ``drain()``
outside a worker signals no process.

Steps run through ``run_message``, as a worker runs a message, in the test's thread, on both
backends (the hand-back, whose run the relay sends again, also on RabbitMQ). Written against
mutants of durable_celery/core/engine.py that the behaviour tests (tests/e2e, with real workers
and signals) never reached."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from durable_celery import current_run
from durable_celery.models import aware
from durable_celery.worker.relay import relay_once
from tests.conftest import BROKERS_AND_SQLITE
from tests.integration.core.helpers import take_over_run
from tests.integration.helpers import delete_queue, queue_depth, run_row

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("backend", BROKERS_AND_SQLITE)
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
    row = run_row(durable, run_id)
    assert (row.status, row.attempt, row.step_index) == ("running", 1, 0)
    assert row.locked_by is None and row.heartbeat_at is None and row.published is False
    assert row.due_at is not None and aware(row.due_at) <= durable.db.utcnow()
    assert durable.list_steps(run_id) == []  # no attempt used
    back = durable.activity(kinds=["handed_back"], run_id=run_id)
    assert [(b.details["step"], b.details["node"]) for b in back] == [("slow", durable.engine.node)]
    # The relay's next pass sends its message again, at once, for the next worker to take.
    queue = durable.app.conf.task_default_queue
    delete_queue(durable.app, queue)  # the message this test's run_message stood in for
    assert relay_once(durable.runtime, durable.app) == 1 and run_row(durable, run_id).published is True
    assert queue_depth(durable.app, queue) == 1
    delete_queue(durable.app, queue)


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


def test_a_cold_shutdown_during_the_grace_period_ends_it_at_the_next_tick(durable, monkeypatch):
    """A worker tells its engine how to see Celery's cold-shutdown flag (``cut_short``): set
    while a grace period runs, the period ends at once; set outside one, it stops nothing."""
    cold = threading.Event()
    monkeypatch.setattr(durable.engine, "cut_short", cold.is_set)
    wf, entered = _slow_step(durable, "cut_short")
    run_id = durable.start(wf)
    result: dict[str, str] = {}
    runner = threading.Thread(
        target=lambda: result.update(status=durable.run_message("cut_short", 0, run_id))
    )
    runner.start()
    try:
        assert entered.wait(10)
        durable.engine.drain(60)
        assert not durable.engine.drain_over()
        cold.set()  # a second Ctrl-C, wherever Celery's handler ran
        assert durable.engine.drain_over()
        runner.join(15)
        assert not runner.is_alive()
    finally:
        durable.engine.undrain()
    assert result == {"status": "handed_back"}
    assert not durable.engine.drain_over()  # the flag alone, with no shutdown begun, ends nothing


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
    status = _drained(durable, run_id, "taken_long", entered, lambda: take_over_run(durable, run_id, how))
    assert status == how
    assert durable.activity(kinds=["handed_back"], run_id=run_id) == []
    fenced = durable.activity(kinds=["worker_fenced"], run_id=run_id)
    assert [e.details["step"] for e in fenced] == (["slow"] if how == "fenced" else [])


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


def test_drain_outside_a_worker_is_refused_and_changes_nothing(durable, monkeypatch):
    """A process that runs no worker (a script, a web process) has nothing to drain: ``drain()``
    says what to do instead, shuts down nothing and signals nobody."""
    from celery.worker import state

    from durable_celery.errors import InvalidArgument

    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    monkeypatch.setattr(state, "should_stop", None)
    with pytest.raises(InvalidArgument, match=r"control shutdown --destination"):
        durable.drain()
    assert not durable.engine.shutting_down() and state.should_stop is None
    assert signalled == []


def test_a_grace_period_is_not_over_before_its_end(durable):
    """Begun, a graceful shutdown's period runs until its end (or a cold shutdown: ``cut_short``,
    which a worker's upkeep sets): an engine outside a worker never cuts it short."""
    engine = durable.engine
    engine.drain(60)
    try:
        assert engine.shutting_down() and not engine.drain_over()
    finally:
        engine.undrain()
