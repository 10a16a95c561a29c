"""Workers that outlive a broker restart: Celery's consumer, with a teardown that cannot kill it.

Since celery/celery#10242 (Celery 5.7.0), a worker that loses its broker connection collects the
connection and then closes it as well. On kombu's Redis transport the collect can leave the task
channel half-closed (its close stops at the first connection error, such as the read of the
pending BRPOP) and unbinds the transport from the connection; the close that follows closes the
channel again, restores its unacknowledged messages through the unbound transport and raises
``AttributeError("'NoneType' object has no attribute 'hostname'")``. Celery takes that for an
unrecoverable error and the worker exits: under load, every worker of the fleet at once.

:class:`Consumer` closes the task channel itself first, while the transport is still bound (its
unacknowledged messages go back to the broker if it answers, as Celery's own teardown would put
them), so the teardown Celery runs next finds it closed. :func:`install` makes it the consumer
class of an app's workers.

Once it has connected again after a lost connection, the consumer has the worker's relay make a
pass at once and another 5 s later (relay.py ``resend_lost``, from a thread of its own): the
messages a restarted broker lost, and those a producer stopped before it could flag, go out
within seconds instead of ``relay_after``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from celery import Celery
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.transport import virtual
from kombu.utils.imports import symbol_by_name

from .relay import BrokerDown, resend_lost

logger = logging.getLogger("durable_celery")

CELERY_CONSUMER = "celery.worker.consumer:Consumer"
CONSUMER = f"{__name__}:Consumer"
TEARDOWN_TIMEOUT = 5.0  # seconds a socket read or connect may take while tearing down
CLOSE_TRIES = 3  # the first close of a Redis channel can stop at its pending BRPOP
RECONNECT_PASSES = (0.0, 5.0)  # seconds before each re-send pass after a reconnect


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer; closes its task channel before Celery tears the lost connection down."""

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        close_task_channel(self)
        super().on_connection_error_after_connected(exc)

    def connect(self) -> Any:
        """Celery's connect; after a reconnect, the relay re-sends what the broker lost."""
        reconnect = not self.first_connection_attempt
        connection = super().connect()
        if reconnect:
            relay_after_reconnect(self.app)
        return connection


def relay_after_reconnect(app: Celery) -> threading.Thread | None:
    """Start relay passes (``RECONNECT_PASSES``) that re-send the runs whose message the broker
    cannot hold (``resend_lost``), in a thread; None when this app's workers run no upkeep."""
    rt = getattr(app, "_durable_runtime", None)
    if rt is None or not rt.settings.upkeep:
        return None

    def relay() -> None:
        # At once, and once more a moment later: a message taken by a consumer when the broker
        # went (in flight, not in the queue) or a depth the broker could not tell yet at the
        # first pass shows at the second. Re-sends stay within each queue's budget.
        for pause in RECONNECT_PASSES:
            time.sleep(pause)
            try:
                sent = resend_lost(rt, app)
            except BrokerDown as exc:  # gone again: the relay thread's passes go on as before
                logger.warning("durable: relay after reconnecting: %s", exc)
                return
            except Exception:
                logger.exception("durable: relay after reconnecting failed; the relay thread goes on")
                return
            if sent:
                logger.warning("durable: the broker is back; the relay sent %d message(s) at once", sent)

    thread = threading.Thread(target=relay, name="durable-relay-reconnect", daemon=True)
    thread.start()
    return thread


def close_task_channel(consumer: Any) -> bool:
    """Close the channel the consumer reads tasks on (up to 3 tries); True once it is closed.

    Every error is swallowed: this runs while the broker is lost, and Celery's teardown comes
    next either way.
    """
    channel = getattr(getattr(consumer, "task_consumer", None), "channel", None)
    if not isinstance(channel, virtual.Channel):
        return True  # not connected yet, or a transport (py-amqp) whose teardown is not affected
    if channel.closed:
        return True
    _bound_open_sockets(consumer.connection)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(TEARDOWN_TIMEOUT)  # for the connection a restore may open
    try:
        for _ in range(CLOSE_TRIES):
            try:
                channel.close()
            except Exception as exc:  # the broker is gone: Celery's own teardown follows anyway
                logger.debug("durable: closing the task channel after a lost broker: %r", exc)
            if channel.closed:
                return True
    finally:
        socket.setdefaulttimeout(previous)
    return False


def _bound_open_sockets(connection: Any) -> None:
    # A read on a socket whose peer went silent never returns; Celery 5.7 bounds them the same way
    # before its own teardown.
    try:
        from celery.utils.threads import bound_open_broker_sockets
    except ImportError:  # Celery before 5.7
        return
    bound_open_broker_sockets(connection, TEARDOWN_TIMEOUT)


def install(app: Celery) -> None:
    """Make :class:`Consumer` the consumer of this app's workers, unless one of your own is set."""
    chosen = app.conf.worker_consumer
    if chosen in (None, CELERY_CONSUMER, CONSUMER):
        app.conf.worker_consumer = CONSUMER
        return
    try:
        ours = issubclass(symbol_by_name(chosen), Consumer)
    except (ImportError, AttributeError, ValueError, TypeError):
        ours = False
    if not ours:
        logger.warning(
            "durable: worker_consumer is %s, which does not subclass %s: a worker may exit when "
            "the broker restarts under load (Celery 5.7.0); derive your consumer from it",
            chosen,
            CONSUMER,
        )
