"""Django: ``INSTALLED_APPS += ["durable_celery.contrib.django"]``, then ``DjangoDurable(app)`` in
``proj/celery.py``. A start inside ``transaction.atomic()`` joins Django's transaction; durable's
database is a Django alias (``CELERY_DURABLE_DATABASE_ALIAS``). See docs/django.md.

Importing this package imports no model: Django imports it while its app registry fills.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DjangoDurable", "django_connection", "durable_for"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import durable

        return getattr(durable, name)
    raise AttributeError(name)
