"""An order, as the view creates it; the workflow ``fulfil`` marks it fulfilled."""

from django.db import models


class Order(models.Model):
    """What a customer bought, the run fulfilling it, and whether it was shipped."""

    item = models.CharField(max_length=100)
    quantity = models.PositiveIntegerField(default=1)
    payment = models.CharField(max_length=40, blank=True)
    run_id = models.CharField(max_length=36, blank=True)  # the run of ``fulfil`` for this order
    fulfilled = models.BooleanField(default=False)
    tracking = models.CharField(max_length=40, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk}: {self.quantity} x {self.item}"
