"""An online shop's durable workflows: a real Celery app (``celery -A examples.shop worker``).

The shop ships inside the package as ``durable_celery.demo_shop`` (read it there: its docstring
says how to run it against PostgreSQL and Redis), so ``python -m durable_celery demo`` runs it
from an installed package too. This module is the same app under the name a checkout uses:
``-A examples.shop`` works wherever ``-A durable_celery.demo_shop`` does.
"""

from __future__ import annotations

from durable_celery.demo_shop import (
    FLAKY_TOKENS,
    KNOWN_POSTCODES,
    PRICES_CENTS,
    QUEUE,
    STOCK,
    AddressNotFound,
    GatewayTimeout,
    OutOfStock,
    app,
    check_address,
    durable,
    place_order,
    send_receipt,
)

__all__ = [
    "FLAKY_TOKENS",
    "KNOWN_POSTCODES",
    "PRICES_CENTS",
    "QUEUE",
    "STOCK",
    "AddressNotFound",
    "GatewayTimeout",
    "OutOfStock",
    "app",
    "check_address",
    "durable",
    "place_order",
    "send_receipt",
]
