"""Watching flow control: each limit's use per key, and why one run waits for its limit.

``flow_report`` reads, for every workflow defined here with ``concurrency``, ``throttle`` or
``rate_limit``, its limits (``FlowLimit.describe()``) and per key what they hold back: slots in
use and runs parked for one, begins in the throttle's window and runs it parked (with the
soonest look again), starts in the rate limit's window. ``explain_wait`` turns a parked run's
row into one line for people. Every read is bounded (store/flow_reads.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument
from ..limits import KINDS
from ..models import aware
from ..store import flow_reads
from ..store.flow_rows import SLOT, THROTTLE

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from ..core.runtime import Runtime
    from ..definition import Workflow
    from ..limits import FlowLimit

KEYS_SHOWN = 50  # keys listed per limit of a workflow, most waiting first


@dataclass(frozen=True)
class KeyUse:
    """One key of one limit: how much of the limit is used, and what waits for it."""

    kind: str  # concurrency, throttle or rate_limit
    key: str  # '' when the limit covers the whole workflow
    limit: int
    period: float | None
    used: int  # slots in use; begins, or starts, in the current window
    waiting: int = 0  # runs parked for a slot, or by the throttle (the rate limit parks none)
    next_look: datetime | None = None  # throttle: when the soonest parked run looks again
    oldest_waiting: datetime | None = None  # when the run parked longest was started
    until: datetime | None = None  # rate limit at its limit: when a start is accepted again


@dataclass(frozen=True)
class WorkflowFlow:
    """A flow-limited workflow: its limits as given and each key's use."""

    workflow: str
    limits: dict[str, dict[str, Any]]
    keys: list[KeyUse] = field(default_factory=list)


def limits_of(workflow: Workflow) -> dict[str, dict[str, Any]]:
    """The workflow's flow limits as shown to people, by kind (none: ``{}``)."""
    found = {kind: getattr(workflow, kind) for kind in KINDS}
    return {kind: limit.describe() for kind, limit in found.items() if limit is not None}


def limited_workflows(rt: Runtime, name: str | None = None) -> list[Workflow]:
    """The workflows defined here with a flow limit (only ``name``, when given), by name."""
    workflows = rt.registry.workflows
    if name is not None and name not in workflows:
        raise InvalidArgument(f"no workflow {name!r} is defined here: one of {', '.join(sorted(workflows))}")
    chosen = [workflows[name]] if name is not None else [workflows[n] for n in sorted(workflows)]
    return [w for w in chosen if limits_of(w)]


def flow_report(rt: Runtime, workflow: str | None = None, keys: int = KEYS_SHOWN) -> list[WorkflowFlow]:
    """Per flow-limited workflow (or only ``workflow``): its limits and, per key, their use; at
    most ``keys`` keys per limit, those with most runs waiting first."""
    if isinstance(keys, bool) or not isinstance(keys, int) or keys < 1:
        raise InvalidArgument(f"keys must be a positive int, not {keys!r}")
    found = []
    with rt.db.engine.connect() as conn:
        for wf in limited_workflows(rt, workflow):
            entry = WorkflowFlow(wf.name or "", limits_of(wf))
            if wf.concurrency is not None:
                entry.keys.extend(_slot_keys(conn, entry.workflow, wf.concurrency, keys))
            if wf.throttle is not None:
                entry.keys.extend(_throttle_keys(rt, conn, entry.workflow, wf.throttle, keys))
            if wf.rate_limit is not None:
                entry.keys.extend(_rate_keys(rt, conn, entry.workflow, wf.rate_limit, keys))
            found.append(entry)
    return found


def _slot_keys(conn: Connection, workflow: str, limit: FlowLimit, keys: int) -> list[KeyUse]:
    return [
        KeyUse(
            "concurrency",
            row.key,
            limit.limit,
            None,
            int(row.in_use or 0),
            int(row.waiting or 0),
            oldest_waiting=aware(row.oldest_waiting),
        )
        for row in flow_reads.slot_use(conn, workflow, keys)
    ]


def _throttle_keys(rt: Runtime, conn: Connection, workflow: str, limit: FlowLimit, keys: int) -> list[KeyUse]:
    period = limit.period or 0.0
    parked = {row.key: row for row in flow_reads.throttled_keys(conn, workflow, keys)}
    names = list(parked)
    for key in flow_reads.recent_throttle_keys(rt.db, conn, workflow, period, keys):
        if len(names) >= keys:
            break
        if key not in parked:
            names.append(key)
    begun = flow_reads.begins_per_key(rt.db, conn, workflow, names, period, limit.limit)
    shown = []
    for key in names:
        row = parked.get(key)
        shown.append(
            KeyUse(
                "throttle",
                key,
                limit.limit,
                period,
                begun.get(key, 0),
                int(row.waiting) if row is not None else 0,
                next_look=aware(row.next_look) if row is not None else None,
                oldest_waiting=aware(row.oldest_waiting) if row is not None else None,
            )
        )
    return shown


def _rate_keys(rt: Runtime, conn: Connection, workflow: str, limit: FlowLimit, keys: int) -> list[KeyUse]:
    period = limit.period or 0.0
    shown = []
    for row in flow_reads.starts_per_key(rt.db, conn, workflow, period, keys):
        started = min(int(row.started), limit.limit)
        oldest = aware(row.oldest)
        full = started >= limit.limit and oldest is not None
        until = _after(oldest, period) if full else None
        shown.append(KeyUse("rate_limit", row.key, limit.limit, period, started, until=until))
    return shown


def _after(at: datetime | None, seconds: float) -> datetime | None:
    return None if at is None else at + timedelta(seconds=seconds)


# -- one run ------------------------------------------------------------------------------------


def explain_wait(rt: Runtime, run: Any, conn: Connection | None = None) -> str | None:
    """Why a run waits for its flow limit, in one line, from its row (``workflow``,
    ``flow_wait``, ``slot_key``, ``throttle_key``, ``due_at``): "waiting for a concurrency slot
    (tenant:A, 2 of 2 in use)" or "throttled until 2026-12-03 15:40:01 UTC (10 per 60s for
    api:c1)"; None when it waits for none."""
    wait = getattr(run, "flow_wait", None)
    workflow = rt.registry.workflows.get(run.workflow)
    if wait == SLOT:
        limit = workflow.concurrency if workflow is not None else None
        key = run.slot_key if run.slot_key is not None else ""
        if conn is None:
            with rt.db.engine.connect() as own:
                used = _slots_in_use(own, run.workflow, key, limit)
        else:
            used = _slots_in_use(conn, run.workflow, key, limit)
        of = f" of {limit.limit}" if limit is not None else ""
        return f"waiting for a concurrency slot ({key_words(key)}, {used}{of} in use)"
    if wait == THROTTLE:
        limit = workflow.throttle if workflow is not None else None
        key = run.throttle_key if run.throttle_key is not None else ""
        until = aware(run.due_at)
        when = "until " + until.strftime("%Y-%m-%d %H:%M:%S UTC") if until is not None else "for now"
        if limit is None:
            return f"throttled {when} ({key_words(key)})"
        return f"throttled {when} ({limit.limit} per {period_words(limit.period)} for {key_words(key)})"
    return None


def _slots_in_use(conn: Connection, workflow: str, key: str, limit: FlowLimit | None) -> int:
    # Counted a little past the limit, so a limit lowered by a deploy shows the overshoot.
    bound = limit.limit * 2 if limit is not None else 1000
    return flow_reads.slots_in_use(conn, workflow, key, bound)


def key_words(key: str) -> str:
    """A flow key for people: the key, or "the whole workflow" for ''."""
    return key if key else "the whole workflow"


def period_words(period: float | None) -> str:
    """A period in seconds as the explanations write it: ``60s``, ``0.5s``."""
    return "-" if period is None else f"{period:g}s"


def use_words(entry: KeyUse) -> str:
    """A key's use in a few words: "2 of 2 in use", "10 of 10 begun in 60s"."""
    if entry.kind == "concurrency":
        return f"{entry.used} of {entry.limit} in use"
    verb = "begun" if entry.kind == "throttle" else "started"
    return f"{entry.used} of {entry.limit} {verb} in {period_words(entry.period)}"


def limit_words(kind: str, shown: dict[str, Any]) -> str:
    """A limit as described (``FlowLimit.describe()``) in words: "2 at once per tenant:{tenant}",
    "10 begins per 60s per api:{customer}", "1 start per 3600s for the whole workflow"."""
    key = shown.get("key")
    per = f"per {key}" if key else "for the whole workflow"
    if kind == "concurrency":
        return f"{shown['limit']} at once {per}"
    what = "begin" if kind == "throttle" else "start"
    plural = "" if shown["limit"] == 1 else "s"
    return f"{shown['limit']} {what}{plural} per {period_words(shown.get('period'))} {per}"
