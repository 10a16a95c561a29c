"""The shop's Django project. Celery's app (and its DjangoDurable) is loaded with Django, as
Celery's Django layout does, so ``@durable.workflow`` and ``start()`` work in views."""

from .celery import app as celery_app

__all__ = ("celery_app",)
