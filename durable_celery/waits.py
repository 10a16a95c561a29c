"""``durable_celery.waits.EventTimeout``, as the docs name it (also in ``durable_celery.errors``);
waits live in ``core/waits.py``."""

from .errors import EventTimeout

__all__ = ["EventTimeout"]
