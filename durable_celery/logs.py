"""``durable_celery.logs.bind``, as the docs name it; log capture lives in ``instrument/logs.py``."""

from .instrument.logs import bind

__all__ = ["bind"]
