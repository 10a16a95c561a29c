"""Why a run is not moving: its queue paused, consumed by no live worker or only by workers
without its code, the flow limit that holds it, a retry waiting out its backoff, a debounce, the
worker running it, the compensation that failed, the event, input or timer it waits for.

``run_state`` gives the parts (the dashboard's run page and its JSON API show them);
``stuck_words`` says the same in one line (``testing.wait_for``'s TimeoutError). The live nodes
and the queues they consume are read from ``durable_nodes``, where every worker also writes the
workflows and steps its code has.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..core.queues import paused_queues, queue_of
from ..core.waits import INPUT, INTERNAL
from ..models import Run, StepRecord, aware
from ..store import node_rows, queries
from ..store.child_rows import CHILDREN_WAIT
from ..store.schema import UNFINISHED
from .flow import clock_words, flow_hold

if TYPE_CHECKING:
    from ..core.runtime import Runtime
    from ..definition import Workflow


def live_nodes(rt: Runtime, now: datetime) -> list[dict[str, Any]]:
    """Nodes seen in the last day, each with ``live``: seen within ``stale_lock_timeout`` and
    not draining (the nodes that take messages)."""
    with rt.db.engine.connect() as conn:
        nodes = [dict(r._mapping) for r in node_rows.list_nodes(conn)]
    live_after = now - timedelta(seconds=rt.settings.stale_lock_timeout)
    for node in nodes:
        seen = aware(node.get("seen_at"))
        node["live"] = seen is not None and seen >= live_after and not node.get("draining")
    return nodes


def consumers(nodes: list[dict[str, Any]], queue: str) -> list[str]:
    """The live nodes that consume ``queue``."""
    return [n["name"] for n in nodes if n["live"] and queue in (n.get("queues") or [])]


def lacking_code(nodes: list[dict[str, Any]], names: list[str], workflow: str, step: str | None) -> list[str]:
    """Of the nodes ``names``, those whose code lacks ``workflow`` (or its ``step``), as their
    rows record it (a node that recorded no steps is taken to have it)."""
    lacking = []
    for node in nodes:
        known = node.get("steps")
        if node["name"] not in names or known is None:
            continue
        if workflow not in known or (step is not None and step not in (known[workflow] or [])):
            lacking.append(node["name"])
    return lacking


def waiting_for(row: Any) -> dict[str, Any] | None:
    """What a run of status ``waiting`` waits for: an ``input`` or an ``event`` (by name), or a
    ``timer`` (a sleep, its children), and until when; None for any other run."""
    if row is None or row.status != "waiting" or not row.wait_name:
        return None
    until = aware(row.wait_until)
    if row.wait_name.startswith(INPUT):
        return {"kind": "input", "name": row.wait_name[len(INPUT) :], "until": until}
    if row.wait_name.startswith(INTERNAL):
        return {"kind": "timer", "name": row.wait_name[len(INTERNAL) :], "until": until}
    return {"kind": "event", "name": row.wait_name, "until": until}


def run_state(rt: Runtime, run: Run, steps: list[StepRecord], workers: bool = True) -> dict[str, Any]:
    """What keeps ``run`` where it is: ``label`` (one phrase, or None when it is moving or
    finished as expected) and the parts behind it (``retry``, ``debounce``, ``queue``,
    ``worker``, ``compensation``, ``flow``, ``wait``). ``workers=False`` (steps run in the
    calling thread, as a ``Fake``'s do): no worker is looked for."""
    now = rt.db.utcnow()
    with rt.db.engine.connect() as conn:
        row = queries.fetch_run(conn, run.id)
    workflow = rt.registry.workflows.get(run.workflow)
    state: dict[str, Any] = dict.fromkeys(
        ("label", "retry", "debounce", "queue", "worker", "compensation", "flow", "wait", "due_at")
    )
    state["step_name"] = row.step_name if row is not None else None
    if row is None:
        return state
    if run.status == "compensation_failed":
        state["compensation"] = _compensation(workflow, run, row, steps)
        state["label"] = f"not compensated: {', '.join(state['compensation']['not_compensated'])}"
        return state
    if run.status not in UNFINISHED and run.status != "compensating":
        return state
    state["due_at"] = due_at = aware(row.due_at)
    state["queue"] = queue = _queue(rt, workflow, run, row, now, workers)
    state["wait"] = waiting_for(row)
    if row.locked_by:
        state["worker"] = {"name": row.locked_by, "heartbeat_at": aware(row.heartbeat_at)}
        return state
    hold = flow_hold(rt, row)
    state["flow"] = None if hold is None else asdict(hold)
    if due_at is None:  # parked without a timer: the waiting section says what it waits for
        queue["no_consumer"] = queue["paused"] = queue["no_code"] = False  # no message is due
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
    if queue["no_code"]:
        return "no worker with its code"
    if flow is not None:
        return str(flow["label"])
    if retry is not None:
        return f"retry {'of compensation ' if retry['compensation'] else ''}backoff"
    return "debounced" if state["debounce"] is not None else None


def _queue(
    rt: Runtime, workflow: Workflow | None, run: Run, row: Any, now: datetime, workers: bool
) -> dict[str, Any]:
    """The queue the run's next message goes to: who consumes it (and which of them lack the
    run's code), whether it is paused; with the live nodes and the queues each consumes."""
    default = rt.default_queue()
    name = row.queue or (queue_of(default, workflow, run.step_index) if workflow is not None else default)
    paused = name in paused_queues(rt.db)
    nodes = live_nodes(rt, now) if workers else []
    takers = consumers(nodes, name)
    lacking = lacking_code(nodes, takers, run.workflow, row.step_name)
    return {
        "name": name,
        "consumers": takers,
        "paused": paused,
        "no_consumer": workers and not takers and not paused,
        "without_code": lacking,
        "no_code": bool(takers) and len(lacking) == len(takers) and not paused,
        "live_nodes": {n["name"]: list(n.get("queues") or []) for n in nodes if n["live"]},
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


# -- in one line ---------------------------------------------------------------------------------


def stuck_words(rt: Runtime, run: Run, steps: list[StepRecord], workers: bool = True) -> str | None:
    """Why ``run`` is not moving, in one line for an error message ("no live worker consumes its
    queue reports (live nodes: celery@a consumes celery)", "held by flow control: waiting for a
    concurrency slot (tenant:A, 2 of 2 in use)"...); None when nothing is known to hold it."""
    state = run_state(rt, run, steps, workers)
    if state["queue"] is None:
        return None
    now = rt.db.utcnow()
    for words in (_queue_words(rt, run, state), _held_words(state, now), _wait_words(run, state, now)):
        if words:
            return words
    return _due_words(state, now)


def _queue_words(rt: Runtime, run: Run, state: dict[str, Any]) -> str | None:
    queue = state["queue"]
    name = queue["name"]
    if queue["paused"]:
        return f"its queue {name} is paused: resume it (durable.resume_queue({name!r}))"
    if queue["no_consumer"]:
        live = queue["live_nodes"]
        seen = "; ".join(f"{n} consumes {', '.join(qs) or 'nothing'}" for n, qs in sorted(live.items()))
        within = f"{rt.settings.stale_lock_timeout:g} s"
        nodes = f"live nodes: {seen}" if seen else f"no node seen in the last {within}"
        return f"no live worker consumes its queue {name} ({nodes}): start one with -Q {name}"
    if queue["no_code"]:
        step = f"step {state['step_name']!r} of workflow" if state["step_name"] else "workflow"
        nodes = ", ".join(queue["without_code"])
        return f"the live workers consuming its queue {name} ({nodes}) lack {step} {run.workflow!r}"
    return None


def _held_words(state: dict[str, Any], now: datetime) -> str | None:
    if state["worker"] is not None:
        worker = state["worker"]
        beat = worker["heartbeat_at"]
        return f"its step is running on {worker['name']}" + (
            f" (last heartbeat {clock_words(beat, now)})" if beat is not None else ""
        )
    if state["flow"] is not None:
        return f"held by flow control: {state['flow']['text']}"
    retry = state["retry"]
    if retry is not None:
        error = retry["error"]
        failed = f"{error.get('type', 'error')}: {error.get('message', '')}"
        of = f" of {retry['of']}" if retry["of"] else ""
        what = "the compensation of step" if retry["compensation"] else "step"
        return (
            f"waiting out a retry backoff: attempt {retry['failed_attempt']} of {what} "
            f"{state['step_name']} failed ({failed}); attempt {retry['next_attempt']}{of} is due "
            f"at {clock_words(retry['due_at'], now)}"
        )
    debounce = state["debounce"]
    if debounce is not None:
        cap = debounce["not_after"]
        latest = f", at the latest {clock_words(cap, now)}" if cap is not None else ""
        return f"debounced: due at {clock_words(debounce['due_at'], now)}{latest}"
    return None


def _wait_words(run: Run, state: dict[str, Any], now: datetime) -> str | None:
    wait = state["wait"]
    if wait is None:
        if run.status == "waiting" and run.runs_after_id:
            return f"waiting behind run {run.runs_after_id}, which holds its key {run.key} (run_again)"
        return None
    until = f" until {clock_words(wait['until'], now)}" if wait["until"] is not None else ""
    if wait["kind"] == "timer":
        if wait["name"] == CHILDREN_WAIT[len(INTERNAL) :]:
            return f"waiting for its child runs{until}"
        return f"asleep{until}"
    return f"waiting for {wait['kind']} {wait['name']!r}{until}"


def _due_words(state: dict[str, Any], now: datetime) -> str | None:
    due_at, queue = state["due_at"], state["queue"]
    if due_at is None:
        return None
    if due_at > now:
        return f"not due until {clock_words(due_at, now)}"
    takers = ", ".join(queue["consumers"])
    consumed = f" (consumed by {takers})" if takers else ""
    return f"due since {clock_words(due_at, now)} on queue {queue['name']}{consumed}, not claimed yet"
