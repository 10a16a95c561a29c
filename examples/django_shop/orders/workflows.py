"""The workflow that fulfils an order (its steps read the order through the ORM), and the one
that takes a payment of ``POST /payments/``.

A step runs in a Celery worker, on the worker's own Django connection, after the request that
started the run committed: the message leaves on commit, so the order is always there to read.
A step may be tried more than once (a retry, a worker killed mid-step, a run taken over after a
stale lock). ``ship`` is atomic: its ORM writes commit together with durable's record of the
step, so they happen once per run however often it is tried, and it writes without checking
first. Only its call to the payment provider, outside the transaction, needs care.

``payment`` authorizes a card (waiting, holding no worker, for its holder's confirmation when the
card asks for one), then takes the money with the run's id as the provider's idempotency key.
"""

from durable_celery import current_run

from shop_project.celery import durable

from . import payments
from .models import Order, Shipment

fulfil = durable.workflow("fulfil", reuse="never")  # one fulfilment per order, ever


@fulfil.step(retry=3, backoff=1.0)
def pick(order_id: int) -> None:
    """Read the order and note what to pick for the next step."""
    order = Order.objects.get(pk=order_id)
    current_run().context["picked"] = f"{order.quantity} x {order.item}"


@fulfil.step(retry=3, backoff=1.0, atomic=True)
def ship(order_id: int) -> dict[str, object]:
    """Ship the order: its shipment, the order fulfilled, its payment captured; the run's output."""
    order = Order.objects.get(pk=order_id)
    shipment = Shipment.objects.create(order=order, tracking=f"TRK-{order.pk}")
    # The provider is not in this step's transaction: a try that rolled back (it raised, or its
    # worker was killed) may have captured already. The same key on every try makes the
    # provider answer a repeat with the first capture instead of taking the money twice.
    order.capture = payments.capture(order, idempotency_key=f"capture:{current_run().id}")
    order.fulfilled, order.tracking = True, shipment.tracking
    order.save(update_fields=["fulfilled", "tracking", "capture"])
    return {
        "order": order.pk,
        "picked": current_run().context["picked"],
        "tracking": order.tracking,
        "capture": order.capture,
    }


# The payment of ``POST /payments/``, keyed by the request's Idempotency-Key. reuse="never": a key
# answers with its run for as long as the run is kept, a failed one included (after_close, the
# default, would let a repeat after the end pay again); idempotency="required": no start without one.
payment = durable.workflow("payment", reuse="never", idempotency="required")


@payment.step
def authorize(amount: int, currency: str, card: str) -> None:
    """Have the card authorized, and confirmed by its holder when the card asks for it."""
    payments.authorize(amount, currency, card)
    # The run parks here, holding no worker, until the bank calls back (the view sends the event).
    if payments.needs_confirmation(card) and not current_run().wait_for_event(
        "confirmed", timeout=900, timeout_value=False
    ):
        raise payments.Declined("the card holder did not confirm")


@payment.step(retry=3, backoff=1.0)
def capture(amount: int, currency: str, card: str) -> dict[str, object]:
    """Take the money, keyed by the run (a retried try pays once); the run's output."""
    charge = payments.pay(amount, currency, card, idempotency_key=f"payment:{current_run().id}")
    return {"charge": charge, "amount": amount, "currency": currency}
