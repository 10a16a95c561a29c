"""The app the volume bench reads a database with: the built workflows, defined as the library
would know them (keys, reuse, flow limits, a timeout, compensations), on a Durable with a
recording outbox (an upkeep pass that sends a message sends nothing anywhere).

``refresh`` moves the unfinished runs' clocks to now before each round, as in a live system:
heartbeats of running steps, the ready backlog due within the last minute, a retry's backoff,
sleeps and workflow timeouts ahead, worker nodes seen now. Without it a database built an hour
ago would have stale locks, overdue runs and sleeps that ended, and the upkeep passes would work
them off instead of doing what a steady pass does: look, and find nothing to do.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery import Celery

from bench.volume_sql import SLOT_LIMIT, WORKFLOWS
from durable_celery import Durable
from durable_celery.testing import RecordingOutbox

# Far beyond the built 30 days: the prune pass looks and deletes nothing for two months.
PRUNE_RULES = {"completed": timedelta(days=90), "failed": timedelta(days=90)}

# What each workflow is defined with; the built rows agree (bench/volume_sql.py).
OPTIONS: dict[str, dict[str, Any]] = {
    "order": {"key": "order:{order_id}"},
    "send_receipt": {"key": "receipt:{order_id}", "reuse": "never"},
    "approval": {"key": "doc:{doc}"},
    "sync_tenant": {"concurrency": {"limit": SLOT_LIMIT, "key": "tenant:{tenant}"}, "timeout": 3600},
    "webhook": {"rate_limit": {"limit": 100_000, "period": 3600, "key": "hook:{endpoint}"}},
}
COMPENSATIONS = {("order", "reserve"): "release_stock", ("order", "charge"): "refund"}

REFRESH = (
    "UPDATE durable_runs SET heartbeat_at = now() - random() * interval '10 s' WHERE locked_by IS NOT NULL",
    "UPDATE durable_runs SET deadline_at = now() + interval '1 hour' "
    "WHERE locked_by IS NOT NULL AND deadline_at IS NOT NULL",
    # The ready backlog: sent, due within the last minute (a re-send is due only after relay_after).
    "UPDATE durable_runs SET due_at = now() - random() * interval '60 s', resends = 0, resend_at = NULL "
    "WHERE due_at IS NOT NULL AND published AND locked_by IS NULL AND status = 'pending'",
    # A retry's backoff and a sleep: due a few minutes from now.
    "UPDATE durable_runs SET due_at = now() + interval '5 min' + random() * interval '5 min' "
    "WHERE due_at IS NOT NULL AND NOT published AND locked_by IS NULL AND status = 'running'",
    "UPDATE durable_runs SET due_at = now() + interval '30 min', wait_until = now() + interval '30 min' "
    "WHERE due_at IS NOT NULL AND status = 'waiting' AND wait_name LIKE 'durable:sleep%'",
    "UPDATE durable_nodes SET seen_at = now()",
)


def define(durable: Durable) -> None:
    """Define the built workflows on ``durable``."""
    for name, steps, _key, queue in WORKFLOWS:
        options = dict(OPTIONS.get(name, {}))
        if queue != "celery":
            options["queue"] = queue
        workflow = durable.workflow(name, **options)
        for step in steps:
            compensation = COMPENSATIONS.get((name, step))
            extra: dict[str, Any] = {}
            if compensation is not None:
                extra["compensate"] = _named(compensation)
            workflow.step(_named(step), name=step, **extra)


def _named(name: str) -> Any:
    """A no-op function called ``name``."""

    def step(**_: Any) -> None:
        """A step that does nothing."""

    step.__name__ = step.__qualname__ = name
    return step


def make_durable(url: str, label: str, prune: dict[str, timedelta] | None = None) -> Durable:
    """A Durable on ``url`` with the built workflows, a recording outbox, upkeep off, and the
    prune rules given (default ``PRUNE_RULES``: nothing due)."""
    app = Celery(f"bench_volume_{label}", broker="memory://")
    app.conf.task_default_queue = "celery"
    durable = Durable(app, url, upkeep=False, outbox=RecordingOutbox(), prune=prune or PRUNE_RULES)
    define(durable)
    return durable


def refresh(durable: Durable) -> None:
    """Move the unfinished runs' clocks to now (see the module's docstring)."""
    from sqlalchemy import text

    with durable.db.engine.begin() as conn:
        for statement in REFRESH:
            conn.execute(text(statement))
