"""Compensation: when a run fails for good, its completed steps are undone in reverse order."""

from __future__ import annotations

import threading

import pytest

from durable_celery import InvalidDefinition, current_run
from durable_celery.testing import wait_for, worker
from tests.conftest import EVERY_STORE

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=EVERY_STORE)
def backend(request: pytest.FixtureRequest) -> str:
    """PostgreSQL, the embedded SQLite default, and the in-memory store."""
    return str(request.param)


def test_completed_steps_are_compensated_in_reverse_order(durable):
    done: list[str] = []
    wf = durable.workflow("trip")

    def cancel_flight(city):
        done.append(f"cancel flight {current_run().context['flight']}")

    def cancel_hotel(city):
        done.append("cancel hotel")

    @wf.step(compensate=cancel_flight)
    def book_flight(city):
        current_run().context["flight"] = f"F-{city}"

    @wf.step  # no compensation: nothing to undo for it
    def notify(city):
        done.append("notify")

    @wf.step(compensate=cancel_hotel)
    def book_hotel(city):
        done.append("hotel")

    @wf.step(retry=2, compensate=lambda city: done.append("never: this step did not complete"))
    def pay(city):
        raise RuntimeError("card declined")

    with worker(durable):
        run = wait_for(durable, durable.start(wf, {"city": "Oslo"}))
    assert run.status == "compensated"
    assert run.error["message"] == "card declined"
    assert done == ["notify", "hotel", "cancel hotel", "cancel flight F-Oslo"]
    rows = [(s.name, s.phase, s.attempt, s.status) for s in durable.list_steps(run.id)]
    assert rows == [
        ("book_flight", "step", 1, "completed"),
        ("notify", "step", 1, "completed"),
        ("book_hotel", "step", 1, "completed"),
        ("pay", "step", 1, "failed"),
        ("pay", "step", 2, "failed"),
        ("book_hotel", "compensate", 1, "completed"),
        ("book_flight", "compensate", 1, "completed"),
    ]


def test_a_compensation_has_its_own_retries_and_can_end_compensation_failed(durable):
    tries = {"refund": 0}
    wf = durable.workflow("order")

    def refund(n):
        tries["refund"] += 1
        if tries["refund"] < 2:
            raise ConnectionError("bank away")

    def never_undone(n):
        tries["other"] = tries.get("other", 0) + 1
        raise RuntimeError("cannot undo")

    @wf.step(compensate=never_undone, compensate_retry=2)
    def reserve(n):
        pass

    @wf.step(compensate=refund, compensate_retry=3)
    def charge(n):
        pass

    @wf.step
    def ship(n):
        raise RuntimeError("warehouse on fire")

    with worker(durable):
        run = wait_for(durable, durable.start(wf, {"n": 1}))
    assert run.status == "compensation_failed"
    assert tries == {"refund": 2, "other": 2}
    phases = [(s.name, s.attempt, s.status) for s in durable.list_steps(run.id) if s.phase == "compensate"]
    assert phases == [
        ("charge", 1, "failed"),
        ("charge", 2, "completed"),
        ("reserve", 1, "failed"),
        ("reserve", 2, "failed"),
    ]
    assert durable.list_steps(run.id)[-1].error["message"] == "cannot undo"


def test_a_run_without_compensations_just_fails(durable):
    wf = durable.workflow("plain")

    @wf.step
    def boom():
        raise ValueError("no")

    with worker(durable):
        run = wait_for(durable, durable.start(wf))
    assert run.status == "failed"


def test_a_compensating_run_cannot_be_cancelled_and_holds_its_key(durable):
    entered, release = threading.Event(), threading.Event()
    wf = durable.workflow("keyed_undo", reuse="after_close")

    def slow_undo(n):
        entered.set()
        release.wait(20)

    @wf.step(compensate=slow_undo)
    def first(n):
        pass

    @wf.step
    def second(n):
        raise RuntimeError("fail")

    with worker(durable):
        run_id = durable.start(wf, {"n": 1}, key="k1")
        assert entered.wait(20)
        assert durable.get_run(run_id).status == "compensating"
        assert durable.cancel(run_id) is False
        assert durable.start(wf, {"n": 2}, key="k1") == run_id  # still the holder
        release.set()
        run = wait_for(durable, run_id)
        assert run.status == "compensated"
        new_id = durable.start(wf, {"n": 3}, key="k1")  # reuse after_close frees it now
    assert new_id != run_id


def test_compensate_must_be_callable():
    from celery import Celery

    from durable_celery import Durable

    durable = Durable(Celery("x", broker="memory://"), "sqlite://", upkeep=False)
    wf = durable.workflow("bad")
    with pytest.raises(InvalidDefinition):
        wf.step(lambda: None, name="a", compensate="nope")
    with pytest.raises(InvalidDefinition):
        wf.step(lambda: None, name="b", compensate_retry=0)
    assert wf.steps == []


def test_a_compensation_can_snooze_without_using_an_attempt(durable):
    passes = []
    wf = durable.workflow("rate_limited_refund")

    def refund():
        passes.append(current_run().attempt)
        if len(passes) == 1:
            current_run().snooze(0.1, "refund API rate limit")

    @wf.step(compensate=refund)
    def charge():
        return "charged"

    @wf.step
    def ship():
        raise RuntimeError("out of stock")

    with worker(durable):
        run = wait_for(durable, durable.start(wf))
    assert run.status == "compensated"
    assert len(passes) == 2 and passes[0] == passes[1]
    (snoozed,) = durable.activity(kinds=["snoozed"], run_id=run.id)
    assert snoozed.details["reason"] == "refund API rate limit"
    rows = [(s.name, s.phase, s.status) for s in durable.list_steps(run.id)]
    assert rows == [
        ("charge", "step", "completed"),
        ("ship", "step", "failed"),
        ("charge", "compensate", "completed"),
    ]
