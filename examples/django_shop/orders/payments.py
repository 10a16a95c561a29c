"""A stand-in for a payment provider: ``tok_declined`` is refused, every other token is paid."""

from .models import Order


class Declined(Exception):
    """The provider refused the payment."""


def charge(order: Order, token: str) -> str:
    """Charge the order with the customer's token; the payment's id, or Declined."""
    if token == "tok_declined":
        raise Declined(f"payment for order {order.pk} declined")
    return f"PAY-{order.pk}"
