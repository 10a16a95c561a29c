"""``durable_celery.beat:DurableScheduler``, the path users give ``beat_scheduler``; the scheduler
lives in ``schedules/beat.py``."""

from .schedules.beat import DurableScheduler

__all__ = ["DurableScheduler"]
