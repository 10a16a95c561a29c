"""The ``orders`` app."""

from django.apps import AppConfig


class OrdersConfig(AppConfig):
    """Orders, and the workflow that fulfils each one."""

    name = "orders"
    default_auto_field = "django.db.models.BigAutoField"
