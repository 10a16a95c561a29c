"""An order, as the view creates it, and its shipment, which the workflow ``fulfil`` makes."""

from django.db import models


class Order(models.Model):
    """What a customer bought, the run fulfilling it, and whether it was shipped."""

    item = models.CharField(max_length=100)
    quantity = models.PositiveIntegerField(default=1)
    payment = models.CharField(max_length=40, blank=True)
    run_id = models.CharField(max_length=36, blank=True)  # the run of ``fulfil`` for this order
    fulfilled = models.BooleanField(default=False)
    tracking = models.CharField(max_length=40, blank=True)
    capture = models.CharField(max_length=40, blank=True)  # the payment captured when it shipped
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk}: {self.quantity} x {self.item}"


class Shipment(models.Model):
    """A parcel sent for an order: ``ship`` creates one per order, in its atomic step."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="shipments")
    tracking = models.CharField(max_length=40)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"shipment {self.tracking} of order {self.order_id}"
