"""The workflow that fulfils an order: its steps read the order through the ORM.

A step runs in a Celery worker, on the worker's own Django connection, after the request that
started the run committed: the message leaves on commit, so the order is always there to read.
A step may run more than once (a retry, a redelivery): ``ship`` checks before it writes.
"""

from django.db import transaction
from durable_celery import current_run

from shop_project.celery import durable

from .models import Order

fulfil = durable.workflow("fulfil", reuse="never")  # one fulfilment per order, ever


@fulfil.step(retry=3, backoff=1.0)
def pick(order_id: int) -> None:
    """Read the order and note what to pick for the next step."""
    order = Order.objects.get(pk=order_id)
    current_run().context["picked"] = f"{order.quantity} x {order.item}"


@fulfil.step(retry=3, backoff=1.0)
def ship(order_id: int) -> dict[str, object]:
    """Mark the order fulfilled with a tracking number, once; the run's output."""
    with transaction.atomic():
        order = Order.objects.select_for_update().get(pk=order_id)
        if not order.fulfilled:
            order.fulfilled = True
            order.tracking = f"TRK-{order.pk}"
            order.save(update_fields=["fulfilled", "tracking"])
    return {"order": order.pk, "picked": current_run().context["picked"], "tracking": order.tracking}
