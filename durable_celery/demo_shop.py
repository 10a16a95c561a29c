"""An online shop's durable workflows: a real Celery app, shipped with the package.

``python -m durable_celery demo`` runs these workflows on the embedded default, in a temporary
directory. The same app runs against PostgreSQL and Redis (``examples/shop.py`` of a checkout
names this module, so ``-A examples.shop`` works there too)::

    export DURABLE_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/shop
    export SHOP_BROKER_URL=redis://127.0.0.1:6379/0
    celery -A durable_celery.demo_shop durable migrate
    celery -A durable_celery.demo_shop worker -l info
    celery -A durable_celery.demo_shop beat -S redbeat.RedBeatScheduler
    celery -A durable_celery.demo_shop flower

RedBeat keeps its schedule in ``SHOP_REDBEAT_URL``, else in the broker's Redis. Left unset,
``DURABLE_DATABASE_URL`` and ``SHOP_BROKER_URL`` fall back to the embedded default: a SQLite
file and the serverless ``durablefs://`` broker under ``.durable/`` in the working directory.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from durable_celery import Durable, current_run

QUEUE = "shop"

BROKER_URL = os.environ.get("SHOP_BROKER_URL") or None
# `celery -A durable_celery.demo_shop beat -S redbeat.RedBeatScheduler` keeps its schedule in Redis.
REDBEAT_URL = os.environ.get("SHOP_REDBEAT_URL") or (
    BROKER_URL if BROKER_URL and BROKER_URL.startswith("redis") else None
)

app = Celery("shop", broker=BROKER_URL)
app.conf.update(task_default_queue=QUEUE, broker_connection_retry_on_startup=True)
if REDBEAT_URL:
    app.conf.redbeat_redis_url = REDBEAT_URL
durable = Durable(app)  # the database comes from DURABLE_DATABASE_URL


# -- the shop's world: fixed data, so every run of a workflow does the same -------------------

PRICES_CENTS = {"mug": 1200, "tee": 2500, "poster": 900}
STOCK = {"mug": 40, "tee": 12, "poster": 0}
FLAKY_TOKENS = {"tok_flaky"}  # a card whose payment gateway times out on the first try
KNOWN_POSTCODES = {"10115", "75001", "SW1A 1AA"}


class OutOfStock(Exception):
    """Not enough units of a product left."""


class GatewayTimeout(Exception):
    """The payment gateway did not answer in time; trying again usually works."""


class AddressNotFound(Exception):
    """The address service does not know this address."""


# -- place_order: reserve stock -> charge -> ship ---------------------------------------------

place_order = durable.workflow("place_order")


@place_order.step(retry=2, backoff=0.2)
def reserve_stock(order_id: str, sku: str, quantity: int, **_: Any) -> dict[str, Any]:
    """Hold the units for this order; the amount to charge goes to the next step."""
    if STOCK.get(sku, 0) < quantity:
        raise OutOfStock(f"only {STOCK.get(sku, 0)} x {sku} left, {quantity} wanted")
    run = current_run()
    run.context["reservation"] = f"RES-{order_id}"
    run.context["amount_cents"] = PRICES_CENTS[sku] * quantity
    return {"reserved": quantity, "sku": sku}


@place_order.step(retry=3, backoff=0.2)
def charge(order_id: str, payment_token: str, **_: Any) -> dict[str, Any]:
    """Charge the card; a flaky gateway times out on the first attempt and is retried."""
    run = current_run()
    if payment_token in FLAKY_TOKENS and run.attempt == 1:
        raise GatewayTimeout(f"payment gateway timed out charging order {order_id}")
    run.context["payment"] = f"PAY-{order_id}-{run.attempt}"
    return {"charged_cents": run.context["amount_cents"]}


@place_order.step
def ship(order_id: str, **_: Any) -> dict[str, Any]:
    """Hand the parcel to the carrier; the run's output is the order summary."""
    context = current_run().context
    return {
        "order": order_id,
        "charged_cents": context["amount_cents"],
        "payment": context["payment"],
        "tracking": f"TRK-{order_id}",
    }


# -- check_address: normalise, then geocode (fails for an unknown address) --------------------

check_address = durable.workflow("check_address")


@check_address.step
def normalise(street: str, postcode: str, **_: Any) -> dict[str, str]:
    """Tidy the address as typed by the customer."""
    current_run().context["postcode"] = " ".join(postcode.upper().split())
    return {"street": " ".join(street.split()).title()}


@check_address.step(retry=2, backoff=0.2)
def geocode(**_: Any) -> dict[str, str]:
    """Ask the address service where this is; an unknown postcode fails every attempt."""
    postcode = current_run().context["postcode"]
    if postcode not in KNOWN_POSTCODES:
        raise AddressNotFound(f"no such postcode: {postcode}")
    return {"postcode": postcode, "zone": "EU" if postcode.isdigit() else "UK"}


# -- send_receipt: a one-step workflow from a function, keyed by its input --------------------


@durable.workflow(key="receipt:{order_id}", reuse="never")
def send_receipt(order_id: str, email: str) -> dict[str, str]:
    """E-mail the receipt of an order, once: the key ``receipt:<order_id>`` comes from the input,
    and ``reuse="never"`` keeps it after the run completed, so starting it again sends nothing."""
    return {"to": email, "subject": f"Your receipt for order {order_id}"}


# -- a keyed schedule: beat starts check_address every morning, one run at a time --------------

# Each fire starts check_address with the key "warehouse": while a morning's run still holds the
# key, the next fire starts nothing. `celery -A durable_celery.demo_shop beat -S redbeat.RedBeatScheduler`
# needs only redbeat_redis_url (set above); Durable sets beat_max_loop_interval to 5 s, so a
# schedule made at run time with `durable.schedule(...)` is seen within seconds.
app.conf.beat_schedule = {
    "warehouse-address": durable.beat_entry(
        check_address, "0 6 * * *", key="warehouse", input={"street": "1 dock road", "postcode": "10115"}
    ),
}
