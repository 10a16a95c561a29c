"""Batches: a workflow's ``batch={"max", "period", "key"}`` gathers its starts into runs.

Every start with one batch key, from its first within ``period`` seconds and up to ``max``
starts, goes into one run whose steps get ``items=[input, ...]`` in start order; each start
returns that run's id. The batch is a row of ``durable_batches`` naming its run, taken with one
upsert inside the start's transaction (the caller's, when it gives one): starts of a batch key
go one after another on its row lock, and a start that rolls back is in no batch. The run is
due when the period ends (the relay sends it at its next pass) or at once when the ``max``-th
start fills it; a start after the run began (or was cancelled) opens the next batch. The run's
flow keys (concurrency, throttle, rate limit) come from its first start's input; a rate limit
counts the runs, not the starts they gather.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import InvalidStart
from ..store import batch_rows

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from ..definition import Workflow
    from ..store.db import Database


def first_item(workflow: Workflow, data: dict[str, Any], key: Any) -> tuple[dict[str, Any], str]:
    """A batch workflow's start: the input of a run holding it alone, and its batch key;
    InvalidStart for a workflow key (a batch's run answers many starts)."""
    assert workflow.batch is not None
    if key is not None:
        raise InvalidStart(
            f"workflow {workflow.name!r} gathers its starts in batches: a start takes no key (the "
            "batch key comes from the input)"
        )
    return {"items": [data]}, workflow.batch.key_for(data, workflow.name)


def gather_txn(
    db: Database, conn: Connection, workflow: Workflow, run: dict[str, Any], create: Callable[[], None]
) -> tuple[str, bool]:
    """Put the start (``run``, holding its input alone) in its batch: the id of the run
    gathering it, and whether the batch is full (its run due now, to be sent after commit).
    ``create()`` writes ``run`` when the start opens a batch."""
    batch = workflow.batch
    assert batch is not None
    name, batch_key, item = run["workflow"], run["batch_key"], run["input"]["items"][0]
    shape = (batch.period, batch.max)
    run_id, items, added = batch_rows.join_txn(db, conn, name, batch_key, run["id"], shape, item)
    if run_id != run["id"]:
        if added:
            full = items >= batch.max
            if full:
                batch_rows.close_txn(db, conn, name, batch_key, run_id)
            return run_id, full
        # Its run began (or was cancelled) before the period ended: this start opens the next.
        batch_rows.drop_txn(conn, name, batch_key, run_id)
        run_id, _, _ = batch_rows.join_txn(db, conn, name, batch_key, run["id"], shape, item)
    create()
    return run_id, False


def drop_closed_once(db: Database) -> int:
    """The upkeep's pass: forget batches that closed by time; how many."""
    with db.begin() as conn:
        return batch_rows.drop_closed(db, conn)
