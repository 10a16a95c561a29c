"""``POST /orders/`` places an order and starts its fulfilment in the request's transaction
(``ATOMIC_REQUESTS``): the order, the run and the run's claim on key ``order:<pk>`` commit
together, or none of them does, and the first step's message is sent once they have committed."""

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from durable_celery import RunNotFound

from shop_project.celery import durable

from . import payments
from .forms import OrderForm
from .models import Order
from .workflows import fulfil


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
