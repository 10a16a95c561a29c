"""Why a run is not moving, for its page: a retry waiting out its backoff, a debounce, a queue
nobody consumes or that is paused, the worker running it, the compensation that failed, a
concurrency slot or the throttle's window it waits for."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..core.queues import paused_queues, queue_of
from ..models import Run, aware
from ..observe.flow import explain_wait
from ..store.schema import UNFINISHED
from . import queries

if TYPE_CHECKING:
    from ..app import Durable
    from ..definition import Workflow


def live_nodes(durable: Durable, now: datetime) -> list[dict[str, Any]]:
    """Nodes seen in the last day, each with ``live``: seen within ``stale_lock_timeout`` and
    not draining (the nodes that take messages)."""
    nodes = durable.list_nodes()
    live_after = now - timedelta(seconds=durable.settings.stale_lock_timeout)
    for node in nodes:
        seen = aware(node.get("seen_at"))
        node["live"] = seen is not None and seen >= live_after and not node.get("draining")
    return nodes


def consumers(nodes: list[dict[str, Any]], queue: str) -> list[str]:
    """The live nodes that consume ``queue``."""
    return [n["name"] for n in nodes if n["live"] and queue in (n.get("queues") or [])]


def run_state(durable: Durable, run: Run, steps: list[Any]) -> dict[str, Any]:
    """What keeps ``run`` where it is: ``label`` (one phrase, or None when it is moving or
    finished as expected) and the parts behind it (``retry``, ``debounce``, ``queue``,
    ``worker``, ``compensation``, ``flow``)."""
    now = durable.db.utcnow()
    with durable.db.engine.connect() as conn:
        row = queries.run_state(conn, run.id)
    workflow = durable.workflows.get(run.workflow)
    state: dict[str, Any] = {
        "step_name": row.step_name if row is not None else None,
        "label": None,
        "retry": None,
        "debounce": None,
        "queue": None,
        "worker": None,
        "compensation": None,
        "flow": None,
    }
    if row is None:
        return state
    if run.status == "compensation_failed":
        state["compensation"] = _compensation(workflow, run, row, steps)
        state["label"] = f"not compensated: {', '.join(state['compensation']['not_compensated'])}"
        return state
    if run.status not in UNFINISHED and run.status != "compensating":
        return state
    due_at, locked_by = aware(row.due_at), row.locked_by
    state["queue"] = queue = _queue(durable, workflow, run, row, now)
    if locked_by:
        state["worker"] = {"name": locked_by, "heartbeat_at": aware(row.heartbeat_at)}
        return state
    state["flow"] = _flow(durable, row)
    if due_at is None:  # parked without a timer: the waiting section says what it waits for
        queue["no_consumer"] = queue["paused"] = False  # no message is due: nothing to flag
    elif state["flow"] is None:  # a throttle's look again is no retry, no debounce
        state["retry"] = _retry(workflow, run, row, steps, due_at)
        state["debounce"] = _debounce(workflow, run, row, due_at, now)
    state["label"] = _label(state)
    return state


def _label(state: dict[str, Any]) -> str | None:
    """The one phrase for what keeps a run waiting: the queue first, then its flow limit, a
    retry's backoff, a debounce."""
    queue, flow, retry = state["queue"], state["flow"], state["retry"]
    if queue["paused"]:
        return "queue paused"
    if queue["no_consumer"]:
        return "no consumer"
    if flow is not None:
        return str(flow["label"])
    if retry is not None:
        return f"retry {'of compensation ' if retry['compensation'] else ''}backoff"
    return "debounced" if state["debounce"] is not None else None


def _flow(durable: Durable, row: Any) -> dict[str, Any] | None:
    """The flow limit a run is parked for: ``wait`` (slot or throttle), its key, ``until``
    (when a throttled run looks again) and the explanation."""
    if row.flow_wait is None:
        return None
    slot = row.flow_wait == "slot"
    return {
        "wait": row.flow_wait,
        "key": row.slot_key if slot else row.throttle_key,
        "until": None if slot else aware(row.due_at),
        "label": "waiting for a concurrency slot" if slot else "throttled",
        "text": explain_wait(durable.runtime, row),
    }


def _retry(workflow: Workflow | None, run: Run, row: Any, steps: list[Any], due_at: datetime) -> Any:
    """The failed attempt a retry waits behind, and when the next attempt is due."""
    phase = "compensate" if run.status == "compensating" else "step"
    failed = [
        s
        for s in steps
        if s.step_index == run.step_index
        and s.phase == phase
        and s.attempt == run.attempt - 1
        and s.status == "failed"
    ]
    if not failed:
        return None
    step = workflow.steps[run.step_index] if workflow and run.step_index < len(workflow.steps) else None
    if step is None:
        of = None
    elif phase == "compensate":
        of = step.compensate_retry
    else:
        of = (row.attempt_base or 0) + step.retry
    last = failed[-1]
    return {
        "compensation": phase == "compensate",
        "failed_attempt": last.attempt,
        "error": last.error or {},
        "failed_at": last.finished_at,
        "next_attempt": run.attempt,
        "of": of,
        "due_at": due_at,
    }


def _debounce(workflow: Workflow | None, run: Run, row: Any, due_at: datetime, now: datetime) -> Any:
    """A debounced start waiting for its burst to end: when it is due, and its cap."""
    debounce = workflow.debounce if workflow is not None else None
    not_after = aware(row.not_after)
    if run.status != "pending" or run.started_at is not None or run.key is None:
        return None
    if debounce is None and not_after is None:
        return None
    return {
        "due_at": due_at,
        "not_after": not_after,
        "period": debounce.get("period") if debounce else None,
        "timeout": debounce.get("timeout") if debounce else None,
        "waiting": due_at > now,
    }


def _queue(durable: Durable, workflow: Workflow | None, run: Run, row: Any, now: datetime) -> dict[str, Any]:
    """The queue the run's next message goes to: who consumes it, whether it is paused."""
    default = durable.runtime.default_queue()
    name = row.queue or (queue_of(default, workflow, run.step_index) if workflow is not None else default)
    takers = consumers(live_nodes(durable, now), name)
    paused = name in paused_queues(durable.db)
    return {"name": name, "consumers": takers, "paused": paused, "no_consumer": not takers and not paused}


def _compensation(workflow: Workflow | None, run: Run, row: Any, steps: list[Any]) -> dict[str, Any]:
    """The compensation that failed for good (the run stops there), its error, and every step
    left uncompensated: that one and the compensated steps before it."""
    index = run.step_index
    tried = [s for s in steps if s.phase == "compensate" and s.step_index == index]
    last = tried[-1] if tried else None
    if workflow is not None and index < len(workflow.steps):
        left = [s.name for s in reversed(workflow.steps[: index + 1]) if s.compensate is not None]
    else:
        left = [row.step_name or (last.name if last else str(index))]
    return {
        "step": row.step_name or (last.name if last else None),
        "index": index,
        "attempts": len(tried),
        "error": (last.error if last else None) or {},
        "not_compensated": left,
        "compensated": [s.name for s in steps if s.phase == "compensate" and s.status == "completed"],
    }
