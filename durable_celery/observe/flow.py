"""Watching flow control: each limit's use per key, and why one run waits for its limit.

``flow_report`` reads, for every workflow defined here with ``concurrency``, ``throttle``,
``rate_limit`` or ``batch``, its limits (``FlowLimit.describe()``) and per key what they hold back: slots in
use and runs parked for one, begins in the throttle's window and runs it parked (with the
soonest look again), starts in the rate limit's window; a ``batch`` workflow's open batches
(key, run, items, when it closes). ``flow_hold`` (``explain_wait``) says in
one line which limit holds a parked run: a concurrency slot, the throttle's window, or the runs
of its key started before it. The run page, the Flow page, ``durable flow``, the JSON API and
``testing.wait_for`` all use these words. Every read is bounded (store/flow_reads.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument, InvalidStart
from ..limits import KINDS
from ..models import aware
from ..store import batch_rows, flow_reads
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
    held: str | None = None  # why its parked runs wait, in the first one's words (held_words)


@dataclass(frozen=True)
class FairShare:
    """One fair key of a fair concurrency limit: its weight, its slots in use and their share of
    the workflow's, and its runs waiting."""

    key: str
    weight: float
    in_use: int
    share: float  # of the workflow's steps in use, 0 to 1
    waiting: int
    oldest_waiting: datetime | None = None  # when its run parked longest was started


@dataclass(frozen=True)
class OpenBatch:
    """One open batch of a batch workflow: its key, the run gathering it, the starts it holds
    (of ``max``), when it opened and when it closes (its run is due then, or at ``max``)."""

    key: str
    run_id: str
    items: int
    max: int
    opened_at: datetime | None
    closes_at: datetime | None


@dataclass(frozen=True)
class WorkflowFlow:
    """A flow-limited workflow: its limits as given, each key's use, each fair key's share (a
    fair concurrency limit), and its parked runs per priority."""

    workflow: str
    limits: dict[str, dict[str, Any]]
    keys: list[KeyUse] = field(default_factory=list)
    fair: list[FairShare] = field(default_factory=list)
    priorities: dict[int, int] = field(default_factory=dict)
    batches: list[OpenBatch] = field(default_factory=list)


def limits_of(workflow: Workflow) -> dict[str, dict[str, Any]]:
    """The workflow's flow limits as shown to people, by kind (none: ``{}``)."""
    found = {kind: getattr(workflow, kind) for kind in (*KINDS, "batch")}
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
                if wf.concurrency.fair is not None:
                    entry.fair.extend(fair_shares(conn, entry.workflow, wf.concurrency, keys))
            entry.priorities.update(flow_reads.parked_priorities(conn, entry.workflow))
            if wf.throttle is not None:
                entry.keys.extend(_throttle_keys(rt, conn, entry.workflow, wf.throttle, keys))
            if wf.rate_limit is not None:
                entry.keys.extend(_rate_keys(rt, conn, entry.workflow, wf.rate_limit, keys))
            if wf.batch is not None:
                entry.batches.extend(open_batches(rt, conn, entry.workflow, wf.batch.max, keys))
            found.append(entry)
    now = rt.db.utcnow()
    for entry in found:
        entry.keys[:] = [replace(k, held=held_words(k, now)) for k in entry.keys]
    return found


def open_batches(rt: Runtime, conn: Connection, workflow: str, most: int, keys: int) -> list[OpenBatch]:
    """The open batches of ``workflow`` (at most ``keys``, closing soonest first)."""
    rows = batch_rows.open_batches(rt.db, conn, workflow, keys)
    return [
        OpenBatch(row.batch_key, row.run_id, int(row.items), most, aware(row.opened_at), aware(row.closes_at))
        for row in rows
    ]


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


def fair_shares(conn: Connection, workflow: str, limit: FlowLimit, keys: int) -> list[FairShare]:
    """The fair keys of ``workflow`` with unfinished runs (at most ``keys``, most waiting first):
    slots in use, their share, runs waiting."""
    rows = flow_reads.fair_use(conn, workflow, keys)
    total = sum(int(row.in_use or 0) for row in rows)
    return [
        FairShare(
            row.key,
            _weight(limit, row.key, workflow),
            int(row.in_use or 0),
            int(row.in_use or 0) / total if total else 0.0,
            int(row.waiting or 0),
            aware(row.oldest_waiting),
        )
        for row in rows
    ]


def _weight(limit: FlowLimit, key: str, workflow: str) -> float:
    """The fair key's weight as shown (a callable that refuses it: 1)."""
    try:
        return limit.weight_of(key, workflow)
    except InvalidStart:
        return 1.0


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

LINE_SHOWN = 1000  # runs in line ahead of one counted for "behind N earlier runs", at most


@dataclass(frozen=True)
class FlowHold:
    """What flow control holds a run for: ``wait`` (slot or throttle), its key, the runs of the
    key started before it that wait too (``behind``), when a throttled run looks again, a short
    ``label`` and the one-line ``text``."""

    wait: str
    key: str
    behind: int
    until: datetime | None
    label: str  # "waiting for a concurrency slot", "throttled", "behind earlier runs of its key"
    text: str


def explain_wait(rt: Runtime, run: Any, conn: Connection | None = None) -> str | None:
    """Why a run waits for its flow limit, in one line (see ``flow_hold``); None when it waits
    for none."""
    held = flow_hold(rt, run, conn)
    return None if held is None else held.text


def flow_hold(rt: Runtime, run: Any, conn: Connection | None = None) -> FlowHold | None:
    """What holds a parked run, from its row (``id``, ``workflow``, ``flow_wait``, ``slot_key``,
    ``throttle_key``, ``due_at``, ``created_at``): "waiting for a concurrency slot (tenant:A,
    2 of 2 in use)", "throttled until 15:40:01 UTC (api:c1, 4 began in the last 10 s)", or, when
    runs of its key started before it wait too, "behind 3 earlier runs of this key (tenant:A,
    waiting for a concurrency slot: 2 of 2 in use)"; None when it is not parked."""
    wait = getattr(run, "flow_wait", None)
    if wait not in (SLOT, THROTTLE):
        return None
    if conn is None:
        with rt.db.engine.connect() as own:
            return _hold(rt, own, run, wait)
    return _hold(rt, conn, run, wait)


def _hold(rt: Runtime, conn: Connection, run: Any, wait: str) -> FlowHold:
    if wait == SLOT:
        key, behind, until, headline, detail = _slot_line(rt, conn, run)
    else:
        key, behind, until, headline, detail = _throttle_line(rt, conn, run)
    if behind:
        words = f"{headline}: {detail}" if detail else headline
        text = f"{behind_words(behind, key)} ({f'{key}, {words}' if key else words})"
        label = "behind earlier runs of its key"
    else:
        text = f"{headline} ({key_words(key)}{', ' + detail if detail else ''})"
        label = "waiting for a concurrency slot" if wait == SLOT else "throttled"
    return FlowHold(wait, key, behind, until, label, text)


def _slot_line(rt: Runtime, conn: Connection, run: Any) -> tuple[str, int, None, str, str]:
    """A run parked for a slot: its key, the runs ahead of it, no look again, the headline and
    the slots in use."""
    workflow = rt.registry.workflows.get(run.workflow)
    limit = workflow.concurrency if workflow is not None else None
    used, behind = flow_reads.slot_line(rt.db, conn, run, LINE_SHOWN)
    detail = slot_use_words(used, limit.limit if limit is not None else None)
    return run.slot_key or "", behind, None, "waiting for a concurrency slot", detail


def _throttle_line(rt: Runtime, conn: Connection, run: Any) -> tuple[str, int, datetime | None, str, str]:
    """A run parked by the throttle: its key, the runs ahead of it, when it looks again, the
    headline and the begins in the window."""
    workflow = rt.registry.workflows.get(run.workflow)
    limit = workflow.throttle if workflow is not None else None
    until = aware(run.due_at)
    headline = "throttled " + ("until " + clock_words(until, rt.db.utcnow()) if until else "for now")
    if limit is None or limit.period is None:  # a throttle a deploy removed: no window to count
        _, behind = flow_reads.throttle_line(rt.db, conn, run, 0.0, 1, LINE_SHOWN)
        return run.throttle_key or "", behind, until, headline, ""
    # Begins counted a little past the limit, so a limit lowered by a deploy shows the overshoot.
    begun, behind = flow_reads.throttle_line(rt.db, conn, run, limit.period, limit.limit * 2, LINE_SHOWN)
    return run.throttle_key or "", behind, until, headline, begun_words(begun, limit.period)


def behind_words(behind: int, key: str) -> str:
    """The runs ahead of one in its key's line: "behind 3 earlier runs of this key" (of this
    workflow, for a limit on the whole workflow; "1000 or more" past ``LINE_SHOWN``)."""
    count = f"{behind} or more" if behind >= LINE_SHOWN else str(behind)
    runs = "run" if behind == 1 else "runs"
    return f"behind {count} earlier {runs} of this {'key' if key else 'workflow'}"


def slot_use_words(used: int, limit: int | None) -> str:
    """Slots in use: "2 of 2 in use" ("2 in use" when the limit is not known here)."""
    return f"{used} of {limit} in use" if limit is not None else f"{used} in use"


def begun_words(begun: int, period: float | None) -> str:
    """Begins in the throttle's window: "4 began in the last 10 s"."""
    return f"{begun} began in the last {seconds_words(period)}"


def seconds_words(seconds: float | None) -> str:
    """A period for the texts about one run: ``10 s``, ``0.5 s``."""
    return "-" if seconds is None else f"{seconds:g} s"


def clock_words(at: datetime, now: datetime) -> str:
    """A time in the coming hours as ``15:40:01 UTC``; with its date when not on today's (UTC)."""
    at = at.astimezone(timezone.utc)
    if at.date() == now.astimezone(timezone.utc).date():
        return at.strftime("%H:%M:%S UTC")
    return at.strftime("%Y-%m-%d %H:%M:%S UTC")


def held_words(entry: KeyUse, now: datetime) -> str | None:
    """Why a key's parked runs wait, in the words of the first one's page: "waiting for a
    concurrency slot (tenant:A, 2 of 2 in use)", "throttled until 15:40:01 UTC (api:c1, 4 began
    in the last 10 s)", and how many more wait behind it; None when none is parked."""
    if not entry.waiting:
        return None
    if entry.kind == "concurrency":
        use = slot_use_words(entry.used, entry.limit)
        first = f"waiting for a concurrency slot ({key_words(entry.key)}, {use})"
    else:
        until = "until " + clock_words(entry.next_look, now) if entry.next_look is not None else "for now"
        first = f"throttled {until} ({key_words(entry.key)}, {begun_words(entry.used, entry.period)})"
    more = entry.waiting - 1
    return first if not more else f"{first}; {more} more {'run' if more == 1 else 'runs'} behind it"


def key_words(key: str) -> str:
    """A flow key for people: the key, or "the whole workflow" for ''."""
    return key if key else "the whole workflow"


def period_words(period: float | None) -> str:
    """A period in seconds as limits and key uses are written: ``60s``, ``0.5s``."""
    return "-" if period is None else f"{period:g}s"


def use_words(entry: KeyUse) -> str:
    """A key's use in a few words: "2 of 2 in use", "10 of 10 begun in 60s"."""
    if entry.kind == "concurrency":
        return f"{entry.used} of {entry.limit} in use"
    verb = "begun" if entry.kind == "throttle" else "started"
    return f"{entry.used} of {entry.limit} {verb} in {period_words(entry.period)}"


def limit_words(kind: str, shown: dict[str, Any]) -> str:
    """A limit as described (``FlowLimit.describe()``) in words: "2 at once per tenant:{tenant}",
    "20 at once for the whole workflow, shared fairly by tenant:{tenant}", "10 begins per 60s
    per api:{customer}", "1 start per 3600s for the whole workflow"."""
    key = shown.get("key")
    per = f"per {key}" if key else "for the whole workflow"
    if kind == "batch":
        return f"up to {shown['max']} starts a run, gathered for {period_words(shown['period'])} {per}"
    if kind == "concurrency":
        fair = f", shared fairly by {shown['fair']}" if shown.get("fair") else ""
        return f"{shown['limit']} at once {per}{fair}"
    what = "begin" if kind == "throttle" else "start"
    plural = "" if shown["limit"] == 1 else "s"
    return f"{shown['limit']} {what}{plural} per {period_words(shown.get('period'))} {per}"
