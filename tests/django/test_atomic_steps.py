"""Atomic steps in Django (issue 40): the step body runs inside ``transaction.atomic`` on
durable's alias, on the worker thread's Django connection, and its ORM writes commit with
durable's record of the step, or not at all. Real Django, PostgreSQL, Redis and a worker."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from durable_celery import current_run
from durable_celery.testing import wait_for, worker
from tests.integration.core.helpers import take_over_run

pytestmark = pytest.mark.timeout(120)


def _workflow(durable: Any, **step: Any) -> Any:
    """A workflow of its own (a name per test) whose one atomic step ships an order by the ORM."""
    from django.db import transaction

    from tests.django.shop.models import Order

    wf = durable.workflow(f"ship_{uuid.uuid4().hex[:8]}")

    @wf.step(atomic=True, **step)
    def ship(order_id: int, fail: int = 0, take_over: str = "") -> dict[str, Any]:
        assert transaction.get_connection().in_atomic_block  # durable's alias, this thread
        order = Order.objects.select_for_update().get(pk=order_id)
        order.details = {**order.details, "shipments": order.details.get("shipments", 0) + 1}
        order.fulfilled = True
        order.save(update_fields=["details", "fulfilled"])
        if take_over:
            take_over_run(durable, current_run().id, take_over)
        if current_run().attempt <= fail:
            raise ConnectionError("the carrier hung up")
        return {"shipments": order.details["shipments"]}

    return wf


def _order() -> Any:
    from tests.django.shop.models import Order

    return Order.objects.create(item="mug", details={})


def _shipments(order: Any) -> int:
    order.refresh_from_db()
    return int(order.details.get("shipments", 0))


def test_an_atomic_steps_orm_writes_commit_once_with_its_record_through_a_worker(durable: Any) -> None:
    wf = _workflow(durable, retry=3, backoff=0.1)
    order = _order()
    run_id = wf.start({"order_id": order.pk, "fail": 2})  # two attempts raise after their write
    with worker(durable):
        run = wait_for(durable, run_id, timeout=30)
    assert run.status == "completed" and run.output == {"shipments": 1}
    assert _shipments(order) == 1 and order.fulfilled is True
    assert [s.status for s in durable.list_steps(run_id)] == ["failed", "failed", "completed"]


@pytest.mark.parametrize("how", ["fenced", "cancelled"])
def test_an_atomic_step_whose_run_moved_on_keeps_none_of_its_orm_writes(durable: Any, how: str) -> None:
    wf = _workflow(durable)
    order = _order()
    run_id = wf.start({"order_id": order.pk, "take_over": how})
    assert durable.run_message(wf.name, 0, run_id) == how
    assert _shipments(order) == 0 and order.fulfilled is False


def test_a_failed_atomic_step_rolls_back_its_orm_writes_and_records_the_failure(durable: Any) -> None:
    wf = _workflow(durable)
    order = _order()
    run_id = wf.start({"order_id": order.pk, "fail": 1})
    assert durable.run_message(wf.name, 0, run_id) == "failed"
    assert _shipments(order) == 0
    (step,) = durable.list_steps(run_id)
    assert step.status == "failed" and "the carrier hung up" in step.error["message"]


def test_an_atomic_step_on_another_alias_is_refused_when_defined(durable: Any) -> None:
    """Another alias is another connection, so another transaction, even on the same server."""
    from durable_celery.errors import InvalidDefinition

    wf = durable.workflow(f"ship_{uuid.uuid4().hex[:8]}")
    wf.step(lambda order_id: None, name="on_default", atomic="default")
    with pytest.raises(InvalidDefinition) as refused:
        wf.step(lambda order_id: None, name="on_lite", atomic="lite")
    assert "'on_lite'" in str(refused.value) and "atomic on lite" in str(refused.value)
    assert [s.name for s in wf.steps] == ["on_default"]
