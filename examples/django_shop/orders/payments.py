"""A stand-in for a payment provider: ``tok_declined`` is refused, every other token is paid.

``charge`` (the view) authorizes the order; ``capture`` (the step ``ship``) takes the money once
the order ships. The provider is another service: nothing it does rolls back with the shop's
database, so ``capture`` takes an idempotency key, as real providers' APIs do.

``authorize`` and ``pay`` serve ``POST /payments/`` (the workflow ``payment``); ``pay`` is keyed
too. A ``tok_3ds`` card's holder must confirm each payment in their bank's app first
(``needs_confirmation``): the bank then calls the shop back, ``POST /payments/<run id>/confirmation/``.
"""

import hashlib

from .models import Order

DECLINED = "tok_declined"
MUST_CONFIRM = "tok_3ds"  # a card whose holder confirms each payment in their bank's app

# What the provider remembers of each idempotency key: the answer it gave first. A real
# provider keeps these on its side (for a day or so); this stand-in, in the process.
_captured: dict[str, str] = {}


class Declined(Exception):
    """The provider refused the payment."""


def charge(order: Order, token: str) -> str:
    """Charge the order with the customer's token; the payment's id, or Declined."""
    if token == DECLINED:
        raise Declined(f"payment for order {order.pk} declined")
    return f"PAY-{order.pk}"


def capture(order: Order, idempotency_key: str) -> str:
    """Capture the order's payment; the capture's id. A key seen before gets the first answer
    again, and nothing more is captured."""
    return _captured.setdefault(idempotency_key, f"CAP-{order.pk}")


def authorize(amount: int, currency: str, token: str) -> None:
    """Have the provider authorize the payment: Declined if it refuses the card."""
    if token == DECLINED:
        raise Declined("the card was declined")


def needs_confirmation(token: str) -> bool:
    """Whether the card's holder must confirm a payment in their bank's app before it is taken."""
    return token == MUST_CONFIRM


def pay(amount: int, currency: str, token: str, idempotency_key: str) -> str:
    """Take an authorized payment once per idempotency key: the charge's id, the first one on a repeat."""
    charge = "CH-" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:12]
    return _captured.setdefault(idempotency_key, charge)
