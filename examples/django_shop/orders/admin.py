"""Orders in the admin, next to durable's runs and keys (the ``durable_celery`` app)."""

from django.contrib import admin

from .models import Order


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Orders, newest first, with their run."""

    list_display = ["id", "item", "quantity", "fulfilled", "tracking", "run_id", "created_at"]
    list_filter = ["fulfilled"]
    ordering = ["-id"]
