"""An order, as a shop's view creates it before starting the workflow that fulfils it."""

from django.db import models


class Order(models.Model):
    """What a customer bought; ``details`` checks that Django's own JSON handling is unchanged."""

    item = models.CharField(max_length=100)
    details = models.JSONField(default=dict)
    fulfilled = models.BooleanField(default=False)
