"""The shop's workflows: fulfilling an order reads it through the ORM, as a user's step would."""

from tests.django.project.celery import durable

from .models import Order

fulfil = durable.workflow("fulfil", key="order:{order_id}")


@fulfil.step
def fulfil_order(order_id):
    order = Order.objects.get(pk=order_id)  # the step sees the committed row
    order.fulfilled = True
    order.save(update_fields=["fulfilled"])
    return {"item": order.item}


# An invoice per customer gathers the order lines started within half a second (core/batches.py).
invoice_lines = durable.workflow(
    "invoice_lines", batch={"max": 50, "period": 0.5, "key": "invoice:{customer}"}
)


@invoice_lines.step
def bill_lines(items):
    return {"lines": [item["order_id"] for item in items]}
