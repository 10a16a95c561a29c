"""Queues: pausing and resuming them on every worker, their counts, and periodic samples.

A pause is a row in ``durable_queues``. It takes effect three ways: the claim refuses a run whose
current queue is paused (exact, whichever worker the message reached), the relay does not send
such runs, and every worker's upkeep stops consuming the queue within a poll interval (see
nodes.py). Resuming clears the row, flags the queue's ready runs for the relay, and the workers
consume the queue again.

No ``cancel_consumer``/``add_consumer`` broadcast: ``add_consumer`` would make every worker
consume the queue, also those started without it; a worker down during the broadcast would miss
it; and the embedded broker has no fanout. The table is the truth every worker follows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument
from ..models import aware
from ..store import activity_rows, queue_rows

if TYPE_CHECKING:
    from ..definition import Workflow
    from ..store.db import Database
    from .runtime import Runtime

log = logging.getLogger("durable_celery")

SAMPLES_KEPT = timedelta(days=7)


def check_queue_name(name: Any) -> str:
    """A queue name: a non-empty str of at most 200 characters."""
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise InvalidArgument(f"a queue name must be a non-empty str of at most 200 characters, not {name!r}")
    return name


def queue_of(default: str, workflow: Workflow, step_index: int) -> str:
    """The Celery queue a step's messages go to (the step's, the workflow's or ``default``, the
    app's default queue)."""
    if step_index >= len(workflow.steps):  # a workflow known here by name only (a schedule's fire)
        return workflow.queue or default
    return workflow.queue_for(workflow.steps[step_index], default) or default


def pause_queue(db: Database, name: str) -> None:
    """Stop every worker from running steps of queue ``name`` until it is resumed."""
    name = check_queue_name(name)
    with db.begin() as conn:
        queue_rows.set_paused_txn(db, conn, name, True)
        activity_rows.record_txn(db, conn, "queue_paused", None, None, None, {"queue": name})
    log.warning("durable: queue %s paused", name)


def resume_queue(db: Database, name: str) -> int:
    """Let workers run queue ``name`` again; returns how many ready runs were sent again."""
    name = check_queue_name(name)
    with db.begin() as conn:
        queue_rows.set_paused_txn(db, conn, name, False)
        rearmed = queue_rows.rearm_ready_txn(db, conn, name)
        activity_rows.record_txn(
            db, conn, "queue_resumed", None, None, None, {"queue": name, "ready": rearmed}
        )
    log.warning("durable: queue %s resumed (%d ready run(s))", name, rearmed)
    return rearmed


def paused_queues(db: Database) -> set[str]:
    """Names of the paused queues."""
    with db.engine.connect() as conn:
        return queue_rows.paused_queues(conn)


@dataclass(frozen=True)
class QueueSample:
    """One queue's counts at one moment."""

    queue: str
    ready: int
    running: int
    waiting: int
    oldest_ready_at: datetime | None
    at: datetime


def queue_stats(rt: Runtime) -> dict[str, dict[str, Any]]:
    """Per queue: ready, running and waiting runs, the oldest ready time, and whether paused.

    Lists every queue a defined workflow uses and every queue an operator paused, even when
    empty. A run is counted on the queue of the step it is at.
    """
    default = rt.default_queue()
    db = rt.db
    with db.engine.connect() as conn:
        counted = queue_rows.count_by_queue(db, conn)
        flags = {r.name: r.paused for r in queue_rows.list_queue_rows(conn)}
    names = {default, *flags}
    for workflow in rt.registry.workflows.values():
        names.update(queue_of(default, workflow, i) for i in range(len(workflow.steps)))
    empty: dict[str, Any] = {"ready": 0, "running": 0, "waiting": 0, "oldest_ready_at": None}
    stats = {name: dict(empty, paused=bool(flags.get(name, False))) for name in names}
    for row in counted:
        entry = stats.setdefault(row.queue or default, dict(empty, paused=bool(flags.get(row.queue))))
        entry["ready"] += int(row.ready or 0)
        entry["running"] += int(row.running or 0)
        entry["waiting"] += int(row.waiting or 0)
        oldest = aware(row.oldest_ready_at)
        if oldest is not None and (entry["oldest_ready_at"] is None or oldest < entry["oldest_ready_at"]):
            entry["oldest_ready_at"] = oldest
    return dict(sorted(stats.items()))


def sample_once(rt: Runtime, every: float) -> bool:
    """Write one sample per queue unless a node did within ``every`` seconds; trims old ones.

    Safe on several nodes at once: one transaction at a time may write (an advisory lock on
    PostgreSQL, the write lock on SQLite), and it skips when a recent sample exists.
    """
    since = rt.db.utcnow() - timedelta(seconds=every * 0.9)
    with rt.db.engine.connect() as conn:
        if queue_rows.sample_written_since(conn, since):  # the usual case on all but one node
            return False
    stats = queue_stats(rt)
    rows = [
        {k: v for k, v in entry.items() if k != "paused"} | {"queue": name} for name, entry in stats.items()
    ]
    db = rt.db
    with db.begin() as conn:
        if not queue_rows.take_sample_turn_txn(conn, since):
            return False
        queue_rows.insert_samples_txn(db, conn, rows)
        queue_rows.trim_samples_txn(conn, db.utcnow() - SAMPLES_KEPT)
    return True


def list_samples(db: Database, queue: str | None = None, since: datetime | None = None) -> list[QueueSample]:
    """Samples of one queue (or all) since ``since`` (default: the last day), oldest first."""
    since = since or db.utcnow() - timedelta(days=1)
    with db.engine.connect() as conn:
        rows = queue_rows.list_samples(conn, queue, since)
    return [
        QueueSample(r.queue, r.ready, r.running, r.waiting, aware(r.oldest_ready_at), aware(r.at) or r.at)
        for r in rows
    ]
