"""A fire of a keyed schedule: the task ``durable.fire_schedule`` a worker runs when beat sends it.

A fire judges the schedule's last run, starts the workflow by name with the schedule's key (the
workflow's ``on_duplicate`` decides what it gets while the key is held), and records the
outcome and the failure count in one statement.

A fire of a workflow that this app does not define, and that no worker node of its database
has ever announced, is refused like Celery's unregistered task: an error names the workflow and
the app, the task fails with ``UnknownWorkflow``, and nothing is written. It was meant for
another app sharing the broker and the queue.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..core.control import after_commit, cancel
from ..core.keys import start_run
from ..core.runs import new_run
from ..definition import SendEvent, Workflow
from ..errors import DurableError, KeyTaken, RateLimited, UnknownWorkflow
from ..inputs import check_input
from ..models import aware
from ..store import activity_rows, node_rows, queries, schedule_rows
from ..store.schema import FINISHED
from .entries import (
    FIRE_TASK,
    config_entries,
    redbeat_entry,
    switch_redbeat,
    uses_durable_scheduler,
    uses_redbeat,
)

if TYPE_CHECKING:
    from ..core.runtime import Runtime

log = logging.getLogger("durable_celery")

# Outcomes whose run has not been judged yet; the next fire judges it.
AWAITING_VERDICT = ("started", "duplicate", "skipped")
FAILED_RUN = ("failed", "compensated", "compensation_failed")


def fire(
    rt: Runtime,
    app: Any,
    name: str,
    workflow: str,
    key: str | None = None,
    input: dict[str, Any] | None = None,
    schedule: str = "",
    policy: dict[str, Any] | None = None,
    manual: bool = False,
) -> dict[str, Any]:
    """Run one fire of a schedule: judge the last run, start with the key, record the outcome."""
    refuse_unknown(rt, app, name, workflow)
    db = rt.db
    with db.engine.connect() as conn:
        row = schedule_rows.fetch_schedule(conn, name)
    if row is None:  # first fire of a beat_schedule entry, or a late fire of a deleted schedule
        if was_deleted(rt, app, name):
            return {"outcome": "deleted", "run_id": None}
        values = {"name": name, "workflow": workflow, "key": key, "schedule": schedule, "input": input}
        with db.begin() as conn:
            schedule_rows.upsert_schedule_txn(db, conn, values, replace=False)
            row = schedule_rows.fetch_schedule(conn, name)
    if not row.enabled:
        return {"outcome": "disabled", "run_id": None}
    verdict = judge(rt, row)
    failures = 0 if verdict == "completed" else row.failures
    failures += verdict_counts(verdict)
    result: dict[str, Any]
    if failures >= rt.settings.schedule_max_failures and verdict is not None:
        result = {"outcome": verdict, "run_id": None}
    else:
        result = start_fire(rt, workflow, key, input, policy)
        if result["outcome"] == "error" and not manual:
            log.warning("durable: schedule %s could not start: %s", name, result["error"])
    record(rt, app, row, verdict, result)
    return result


def refuse_unknown(rt: Runtime, app: Any, name: str, workflow: str) -> None:
    """UnknownWorkflow (and an error logged) when neither this app nor any worker node of its
    database has the workflow: the fire was taken by the wrong app."""
    if workflow in rt.registry.workflows:
        return
    with rt.db.engine.connect() as conn:
        nodes = node_rows.list_nodes(conn)
    if any(workflow in (node.steps or {}) for node in nodes):
        return  # a node with the code runs the run this fire creates (a rolling deploy)
    message = (
        f"refused a fire of schedule {name!r}: workflow {workflow!r} is not defined in app "
        f"{getattr(app, 'main', None)!r}, and no worker node of its database has it; nothing was "
        "written (is the fire meant for another app on the same broker and queue?)"
    )
    log.error("durable: %s", message)
    raise UnknownWorkflow(message)


def was_deleted(rt: Runtime, app: Any, name: str) -> bool:
    """Is this a run-time schedule deleted after beat sent this fire? (Then it starts nothing.)"""
    if name in config_entries(app):
        return False
    if uses_redbeat(app):
        return redbeat_entry(app, name) is None
    return uses_durable_scheduler(app)


def verdict_counts(verdict: str | None) -> int:
    """How many failures a verdict on the last run adds (a completed run resets the count)."""
    return 1 if verdict in (*FAILED_RUN, "not_picked_up") else 0


def judge(rt: Runtime, row: Any) -> str | None:
    """The outcome of the schedule's last run if it is known now: its final status, or
    ``not_picked_up`` (and cancelled) when no worker claimed it within the pickup timeout."""
    if row.last_outcome not in AWAITING_VERDICT or row.last_run_id is None:
        return None
    with rt.db.engine.connect() as conn:
        run = queries.fetch_run(conn, row.last_run_id)
    if run is None:
        return None
    if run.status in FINISHED:
        return str(run.status)
    created = aware(run.created_at)
    waited = (rt.db.utcnow() - created).total_seconds() if created is not None else 0.0
    unclaimed = run.status == "pending" and run.started_at is None
    if unclaimed and waited > rt.settings.schedule_pickup_timeout:
        cancel(rt, run.id)
        return "not_picked_up"
    return None


def _stand_in(workflow: str, policy: dict[str, Any] | None) -> Workflow:
    """The start rules of a workflow this process has no code for, as its schedule carries them."""
    policy = policy or {}
    on_duplicate = policy.get("on_duplicate", "use_existing")
    if isinstance(on_duplicate, dict):
        on_duplicate = SendEvent(on_duplicate["event"])
    return Workflow(
        name=workflow,
        reuse=policy.get("reuse", "after_close"),
        on_duplicate=on_duplicate,
        timeout=policy.get("timeout"),
    )


def start_fire(
    rt: Runtime, workflow: str, key: str | None, input: Any, policy: dict[str, Any] | None
) -> dict[str, Any]:
    """Start the workflow by name with the schedule's key, by the workflow's ``on_duplicate``.

    A worker without the workflow's code (a node of its database has it, ``refuse_unknown``)
    still creates the run; it is left for the relay of a node that has the code to send."""
    known = rt.registry.workflows.get(workflow)
    wf = known if known is not None and known.steps else _stand_in(workflow, policy)
    try:
        data = check_input(input)
        run = new_run(
            rt.default_queue(), wf, data, wf.derive_key(data, key), aging=rt.settings.priority_aging
        )
        if wf is not known:
            run["published"] = False
        decision = start_run(rt, wf, run, wf.on_duplicate)
        after_commit(rt, decision)
    except KeyTaken as exc:
        return {"outcome": "skipped", "run_id": exc.holder_id}
    except RateLimited as exc:  # the workflow's rate_limit: this fire is not a failure
        return {"outcome": "rate_limited", "run_id": None, "error": str(exc), "refusal": exc}
    except (DurableError, ValueError) as exc:
        return {"outcome": "error", "run_id": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"outcome": "started" if decision.created else "duplicate", "run_id": decision.run_id}


def record(rt: Runtime, app: Any, row: Any, verdict: str | None, result: dict[str, Any]) -> None:
    """Write the fire's outcome and the failure count in one statement; switch the schedule off
    (recording ``schedule_disabled``) when it reaches ``schedule_max_failures``."""
    db, limit = rt.db, rt.settings.schedule_max_failures
    fire_failed = 1 if result["outcome"] == "error" else 0
    with db.begin() as conn:
        saved = schedule_rows.record_fire_txn(
            db,
            conn,
            row.name,
            outcome=result["outcome"],
            run_id=result["run_id"],
            add_failures=verdict_counts(verdict) + fire_failed,
            reset=verdict == "completed",
            max_failures=limit,
            seen=(row.last_run_id, row.last_outcome) if verdict is not None else None,
        )
        if saved is None and verdict is not None:  # another fire judged that run meanwhile
            saved = schedule_rows.record_fire_txn(
                db,
                conn,
                row.name,
                outcome=result["outcome"],
                run_id=result["run_id"],
                add_failures=fire_failed,
                reset=False,
                max_failures=limit,
            )
        disabled = saved is not None and not saved.enabled
        if disabled:
            details = {"schedule": row.name, "failures": saved.failures, "outcome": result["outcome"]}
            if "error" in result:
                details["error"] = result["error"]
            activity_rows.record_txn(
                db, conn, "schedule_disabled", saved.last_run_id, row.workflow, row.key, details
            )
    if disabled:
        log.warning("durable: schedule %s disabled after %d failures in a row", row.name, saved.failures)
        try:
            switch_redbeat(app, row.name, False)
        except Exception as exc:  # the row is the truth: a disabled row's fires are dropped
            log.warning("durable: could not disable RedBeat entry %s: %s", row.name, exc)


def install(rt: Runtime, app: Any) -> None:
    """Register the fire task ``durable.fire_schedule`` on the app."""

    def fire_schedule(
        name: str,
        workflow: str,
        key: str | None = None,
        input: dict[str, Any] | None = None,
        schedule: str = "",
        policy: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Fire a durable schedule: start its workflow with its key."""
        return fire(rt, app, name, workflow, key, input, schedule, policy)

    app.task(name=FIRE_TASK, shared=False, ignore_result=True, serializer="json", typing=False)(fire_schedule)
