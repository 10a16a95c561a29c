"""``POST /orders/`` places an order and starts its fulfilment in the request's transaction
(``ATOMIC_REQUESTS``): the order, the run and the run's claim on key ``order:<pk>`` commit
together, or none of them does, and the first step's message is sent once they have committed.

``POST /payments/`` takes a payment keyed by the request's ``Idempotency-Key`` header and waits
``PAYMENT_WAIT`` seconds (a setting, 3 by default) for its answer: 201 with the result, or 202
with the run's id while it goes on (``GET /payments/<run id>/`` polls). A repeat with the same
key and body gets the same run's answer, even while the first request's run still goes; the same
key with another body gets 409; no key or a bad body, 400; a declined payment, 402.
"""

import json
import re
from typing import Any

from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from durable_celery import InvalidKey, KeyTaken, ResultTimeout, Run, RunCancelled, RunFailed, RunNotFound

from shop_project.celery import durable

from . import payments
from .forms import OrderForm
from .models import Order
from .workflows import fulfil, payment


@csrf_exempt  # an API for other services: authenticate them in a real shop
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    """Create the order, start ``fulfil`` for it, charge it: 201, or 400/402 with nothing kept."""
    form = OrderForm(request.POST)
    if not form.is_valid():
        return JsonResponse({"errors": form.errors}, status=400)
    order = form.save()
    # Joins the request's transaction: nothing is visible to a worker, nor sent, before it commits.
    run_id = fulfil.start({"order_id": order.pk}, key=f"order:{order.pk}")
    try:
        # After the start on purpose: whatever fails later in the request takes the run with it.
        order.payment = payments.charge(order, form.cleaned_data["payment_token"])
    except payments.Declined as declined:
        transaction.set_rollback(True)  # the order, the run and its key claim: all gone
        return JsonResponse({"error": str(declined)}, status=402)
    order.run_id = run_id
    order.save(update_fields=["payment", "run_id"])
    return JsonResponse({"order": order.pk, "run": run_id}, status=201)


@require_GET
def order_detail(request: HttpRequest, pk: int) -> JsonResponse:
    """The order and its run's status."""
    order = get_object_or_404(Order, pk=pk)
    try:
        status = durable.get_run(order.run_id).status if order.run_id else None
    except RunNotFound:  # pruned: durable keeps finished runs for a while only
        status = None
    return JsonResponse(
        {"order": order.pk, "item": order.item, "fulfilled": order.fulfilled, "run_status": status}
    )


PAYMENT = ("amount", "currency", "card")  # a payment's body: a JSON object with these fields only
CURRENCY = re.compile("[A-Z]{3}")


def read_payment(request: HttpRequest) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The request's payment, or None and what is wrong with its body, field by field."""
    try:
        body = json.loads(request.body)
    except ValueError:  # not JSON, or not UTF-8
        return None, {"body": "must be a JSON object"}
    if not isinstance(body, dict):
        return None, {"body": "must be a JSON object"}
    errors = payment_errors(body)
    return (None if errors else body), errors


def payment_errors(body: dict[str, Any]) -> dict[str, str]:
    """What is wrong with a payment's fields, by field (nothing: it is a payment)."""
    # Exact fields and types: the body's equality with a run's input is then the request's identity.
    amount, currency, card = (body.get(name) for name in PAYMENT)
    errors = {name: "is not a field of a payment" for name in body if name not in PAYMENT}
    if type(amount) is not int or amount < 1:
        errors["amount"] = "must be a whole number of the currency's minor unit, at least 1 (2500 is 25.00)"
    if not isinstance(currency, str) or not CURRENCY.fullmatch(currency):
        errors["currency"] = "must be three capital letters, like EUR"
    if not isinstance(card, str) or not 0 < len(card) <= 64:
        errors["card"] = "must be a card token of 1 to 64 characters"
    return errors


@transaction.non_atomic_requests  # the run commits at its start, so a worker takes it while we wait
@csrf_exempt  # an API for other services: authenticate them in a real shop
@require_POST
def create_payment(request: HttpRequest) -> JsonResponse:
    """Start the payment keyed by the Idempotency-Key header; its answer, or 202 after PAYMENT_WAIT s."""
    key = request.headers.get("Idempotency-Key")
    if not key:
        return JsonResponse({"error": "an Idempotency-Key header is required"}, status=400)
    body, errors = read_payment(request)
    if body is None:
        return JsonResponse({"error": "the body is not a payment", "errors": errors}, status=400)
    try:
        # The key's row decides, inside the start's transaction: of two requests racing with one
        # key, one makes the run; the other is refused, told the holder and whether its body
        # differs from the holder's input (JSON equality), for a holder still going or ended
        # alike. (A real API scopes the key by its client: key=f"{client}:{key}".)
        run_id = payment.start(body, key=key, on_duplicate="error")
    except KeyTaken as taken:
        if taken.input_changed:
            message = f"Idempotency-Key {key!r} was already used with another payment"
            return JsonResponse({"error": message, "run_id": taken.holder_id}, status=409)
        run_id = taken.holder_id  # the same payment again: the first request's answer
    except InvalidKey as exc:  # longer than 255 bytes, say
        return JsonResponse({"error": f"Idempotency-Key: {exc}"}, status=400)
    return payment_answer(run_id, float(getattr(settings, "PAYMENT_WAIT", 3.0)), done=201)


@require_GET
def payment_detail(request: HttpRequest, run_id: str) -> JsonResponse:
    """The payment's answer now: 200 with its result, 402 if it failed, 202 while it goes on, or 404."""
    run = payment_run(run_id)
    if run is None:
        return JsonResponse({"error": f"no payment {run_id}"}, status=404)
    if not run.finished:  # no wait: the client polls
        return still_going(run_id, run.status)
    return payment_answer(run_id, 0, done=200)


@csrf_exempt  # the bank's call back: check its signature in a real shop
@require_POST
def confirm_payment(request: HttpRequest, run_id: str) -> JsonResponse:
    """The card holder confirmed in their bank's app: 202, the event kept until the run waits for it."""
    if payment_run(run_id) is None:
        return JsonResponse({"error": f"no payment {run_id}"}, status=404)
    durable.send_event(run_id, "confirmed", True, buffer=True)
    return JsonResponse({"run_id": run_id}, status=202)


def payment_run(run_id: str) -> Run | None:
    """The run of ``payment`` with that id, or None."""
    try:
        run = durable.get_run(run_id)
    except RunNotFound:
        return None
    return run if run.workflow == payment.name else None


def payment_answer(run_id: str, wait: float, done: int) -> JsonResponse:
    """The run's answer within ``wait`` seconds: ``done`` with its result, 402 if it did not complete, 202."""
    try:
        result = durable.result(run_id, timeout=wait)
    except ResultTimeout as late:
        return still_going(run_id, late.status)
    except RunFailed as failed:
        body = {"run_id": run_id, "status": failed.status, "error": failed.error_message}
        return JsonResponse({**body, "error_type": failed.error_type}, status=402)
    except RunCancelled as cancelled:
        body = {"run_id": run_id, "status": "cancelled", "error": cancelled.reason or "cancelled"}
        return JsonResponse(body, status=402)
    return JsonResponse({"run_id": run_id, "status": "completed", "result": result}, status=done)


def still_going(run_id: str, status: str) -> JsonResponse:
    """202 with the run's id and status, and where to ask again (Location)."""
    response = JsonResponse({"run_id": run_id, "status": status}, status=202)
    response["Location"] = reverse("payment-detail", args=[run_id])
    return response
