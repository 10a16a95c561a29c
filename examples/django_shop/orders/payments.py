"""A stand-in for a payment provider: ``tok_declined`` is refused, every other token is paid.

``charge`` (the view) authorizes the order; ``capture`` (the step ``ship``) takes the money once
the order ships. The provider is another service: nothing it does rolls back with the shop's
database, so ``capture`` takes an idempotency key, as real providers' APIs do.
"""

from .models import Order

# What the provider remembers of each idempotency key: the answer it gave first. A real
# provider keeps these on its side (for a day or so); this stand-in, in the process.
_captured: dict[str, str] = {}


class Declined(Exception):
    """The provider refused the payment."""


def charge(order: Order, token: str) -> str:
    """Charge the order with the customer's token; the payment's id, or Declined."""
    if token == "tok_declined":
        raise Declined(f"payment for order {order.pk} declined")
    return f"PAY-{order.pk}"


def capture(order: Order, idempotency_key: str) -> str:
    """Capture the order's payment; the capture's id. A key seen before gets the first answer
    again, and nothing more is captured."""
    return _captured.setdefault(idempotency_key, f"CAP-{order.pk}")
