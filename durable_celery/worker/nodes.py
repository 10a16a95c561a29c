"""This worker node as the database sees it: its heartbeat row, and its consumers kept in line
with the paused queues.

Runs inside the worker's upkeep thread. The queues a node announces are the ones its consumer
consumes now, read from the live task consumer, so an operator's ``celery control
cancel_consumer`` or ``add_consumer`` shows in ``durable nodes`` and in ``doctor`` within a
relay pass. Consumer changes are handed to the worker's event loop with ``call_soon`` (the same
way Celery's own ``cancel_consumer`` control command does it), and only queues durable itself
stopped for a pause are consumed again on resume.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..store import node_rows

if TYPE_CHECKING:
    from ..core.runtime import Runtime

log = logging.getLogger("durable_celery")

FORGET_AFTER = timedelta(days=1)


class Node:
    """One worker node: announces itself, heartbeats, and pauses/resumes its own consumers."""

    def __init__(self, rt: Runtime, app: Any, worker: Any = None) -> None:
        self.rt = rt
        self.app = app
        self.worker = worker
        self.name = getattr(worker, "hostname", None) or f"{socket.gethostname()}:{os.getpid()}"
        self.queues = self._started_queues()
        self.cancelled: set[str] = set()  # queues durable stopped consuming for a pause
        self._steps_written: dict[str, list[str]] | None = None
        self._queues_written: list[str] | None = None

    def _started_queues(self) -> list[str]:
        if self.worker is None:
            return []
        selected = self.app.amqp.queues.consume_from
        return sorted(selected) if selected else [self.app.conf.task_default_queue]

    def _live_queues(self) -> list[str] | None:
        """The queues the worker's task consumer consumes now; None before it has started."""
        task_consumer: Any = getattr(getattr(self.worker, "consumer", None), "task_consumer", None)
        if getattr(task_consumer, "queues", None) is None:
            return None
        for _ in range(3):  # the event loop may change the consumer's queues while we read them
            try:
                return sorted({q.name for q in task_consumer.queues})
            except RuntimeError:
                continue
        return None

    def steps(self) -> dict[str, list[str]]:
        """The workflows and step names this node's code has."""
        return {
            name: [step.name for step in wf.steps] for name, wf in sorted(self.rt.registry.workflows.items())
        }

    def register(self) -> None:
        """Write this node's row afresh (at start)."""
        self._steps_written = self.steps()
        queues = self.consumed()
        with self.rt.db.begin() as conn:
            node_rows.register_node_txn(self.rt.db, conn, self.name, queues, os.getpid(), self._steps_written)
        self._queues_written = queues

    def beat(self) -> None:
        """Mark this node seen (re-registering if its row was forgotten); forget long-gone nodes."""
        db = self.rt.db
        steps = self.steps()
        queues = self.consumed()
        changed = steps if steps != self._steps_written else None  # workflows defined late
        with db.begin() as conn:
            if not node_rows.beat_node_txn(db, conn, self.name, queues, os.getpid(), changed):
                node_rows.register_node_txn(db, conn, self.name, queues, os.getpid(), steps)
            node_rows.forget_nodes_txn(conn, db.utcnow() - FORGET_AFTER)
        self._steps_written = steps
        self._queues_written = queues

    def consumed(self) -> list[str]:
        """The queues this node consumes now: its live consumer's (before the consumer starts,
        its start queues), less those it stops consuming for a pause."""
        live = self._live_queues()
        return [q for q in (self.queues if live is None else live) if q not in self.cancelled]

    def reconcile(self, paused: set[str]) -> None:
        """Stop consuming this node's paused queues, consume its resumed ones again, and write
        the node row at once when its consumer's queues changed (``cancel_consumer``,
        ``add_consumer``)."""
        consumer = getattr(self.worker, "consumer", None)
        if consumer is None or getattr(consumer, "task_consumer", None) is None:
            return
        live = self._live_queues()
        for queue in self.queues if live is None else live:
            if queue in paused and queue not in self.cancelled:
                self.cancelled.add(queue)
                consumer.call_soon(consumer.cancel_task_queue, queue)
                log.info("durable: %s stops consuming paused queue %s", self.name, queue)
        for queue in sorted(self.cancelled):
            if queue not in paused:
                self.cancelled.discard(queue)
                consumer.call_soon(consumer.add_task_queue, queue)
                log.info("durable: %s consumes resumed queue %s again", self.name, queue)
        if self._queues_written is not None and self.consumed() != self._queues_written:
            self.beat()
