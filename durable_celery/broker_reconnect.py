"""``durable_celery.broker_reconnect:Consumer``, the path users give ``worker_consumer``; the
consumer lives in ``worker/broker_reconnect.py``."""

from .worker.broker_reconnect import Consumer

__all__ = ["Consumer"]
