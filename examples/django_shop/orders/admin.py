"""Orders and shipments in the admin, next to durable's runs and keys (the ``durable_celery`` app)."""

from django.contrib import admin

from .models import Order, Shipment


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Orders, newest first, with their run."""

    list_display = ["id", "item", "quantity", "fulfilled", "tracking", "capture", "run_id", "created_at"]
    list_filter = ["fulfilled"]
    ordering = ["-id"]


@admin.register(Shipment)
class ShipmentAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Shipments, newest first: one per order, made by the atomic step ``ship``."""

    list_display = ["id", "order", "tracking", "created_at"]
    ordering = ["-id"]
