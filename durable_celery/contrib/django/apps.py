"""The Django app ``durable_celery`` (``INSTALLED_APPS += ["durable_celery.contrib.django"]``)."""

from __future__ import annotations

from django.apps import AppConfig


class DurableConfig(AppConfig):
    """durable_celery in Django: its tables as migrations, its runs in the admin."""

    name = "durable_celery.contrib.django"
    label = "durable_celery"
    verbose_name = "Durable workflows"
    default_auto_field = "django.db.models.BigAutoField"
