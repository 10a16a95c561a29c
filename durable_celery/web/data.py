"""What each dashboard page shows, as plain data: the HTML pages and the JSON API share it."""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, fields, is_dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..errors import DatabaseUnavailable, InvalidArgument
from ..models import Run, aware
from ..observe.activity import key_blocks, key_entries
from ..observe.flow import flow_report, key_words, limit_words, limits_of, use_words
from ..paging import check_after, check_key_cursor
from ..store import activity_rows, dashboard_rows, flow_reads, observe_rows
from ..store.db import masked_url
from ..store.schema import UNFINISHED
from . import why
from .bulk import filter_of

if TYPE_CHECKING:
    from ..app import Durable

RUN_ID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
SECRET_WORDS = ("password", "secret", "token")
RUNS_OF_KEY = 50  # runs listed in a run's key view, newest first
MAX_PAGE = 20  # runs pages by number; past it, by after= (keyset)


def jsonable(value: Any) -> Any:
    """``value`` with dataclasses, datetimes and rows turned into JSON types."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def check_limit(value: Any, default: int = 50, most: int = 500) -> int:
    """A page size from a query string: a positive int, at most ``most``."""
    if value in (None, ""):
        return default
    try:
        limit = int(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"limit must be a positive number, not {value!r}") from None
    if limit < 1:
        raise InvalidArgument(f"limit must be a positive number, not {value!r}")
    return min(limit, most)


def check_page(value: Any) -> int:
    """A 1-based page number from a query string, up to ``MAX_PAGE`` (deeper pages go by
    ``after=``: an offset reads every row before the page)."""
    try:
        page = max(1, int(value or 1))
    except (TypeError, ValueError):
        raise InvalidArgument(f"page must be a number, not {value!r}") from None
    if page > MAX_PAGE:
        raise InvalidArgument(f"page {page} is past page {MAX_PAGE}: follow the pages' 'older' link (after=)")
    return page


def check_status(value: Any) -> str | None:
    """A status filter: empty or one of the statuses."""
    if not value:
        return None
    if value not in dashboard_rows.STATUSES:
        raise InvalidArgument(f"unknown status {value!r}; one of {', '.join(dashboard_rows.STATUSES)}")
    return str(value)


# -- overview --------------------------------------------------------------------------------


def overview(durable: Durable) -> dict[str, Any]:
    """Runs per status and those held by flow control, ready backlog per workflow and queue,
    failures of the last hour, nodes, paused queues and the schema state."""
    db = durable.db
    now = db.utcnow()
    with db.engine.connect() as conn:
        counts = observe_rows.status_counts(conn)
        ready = observe_rows.ready_by_workflow(db, conn)
        failed = dashboard_rows.failed_since(conn, now - timedelta(hours=1))
        stale = observe_rows.stale_lock_count(db, conn, durable.settings.stale_lock_timeout)
        gauges = flow_reads.flow_gauges(conn)
    queue_list = queues_data(durable)
    return {
        "runs": counts,
        # Runs parked for a slot or by the throttle: their status stays pending, running or
        # waiting (a sleep that ended), so they are counted apart from the "waiting" status.
        "held_by_flow": sum(int(g.n) for g in gauges if g.what != flow_reads.IN_USE),
        "count_cap": observe_rows.COUNT_CAP,
        "ready_by_workflow": [
            {"workflow": r.workflow, "ready": int(r.ready), "oldest": aware(r.oldest)} for r in ready
        ],
        "queues": queue_list["queues"],
        "failed_last_hour": failed,
        "stale_locks": stale,
        "nodes": queue_list["nodes"],
        "paused_queues": [q["name"] for q in queue_list["queues"] if q["paused"]],
        "schema": schema_state(durable),
        "replica": replica_state(durable),
    }


def replica_state(durable: Durable) -> dict[str, Any] | None:
    """Where the pages read: the read replica and how far behind it is (None without one)."""
    try:
        lag = durable.replication_lag()
    except DatabaseUnavailable as exc:
        return {"database": durable.reads.masked_url, "lag": None, "error": str(exc)}
    if lag is None:
        return None
    return {"database": durable.reads.masked_url, "lag": round(lag, 1), "error": None}


def schema_state(durable: Durable) -> dict[str, Any]:
    """Pending migrations, or the error that kept them from being read."""
    try:
        pending = durable.pending_migrations()
    except Exception as exc:  # a database the dashboard cannot read: say so on the page
        return {"up_to_date": False, "pending": [], "error": f"{type(exc).__name__}: {exc}"}
    return {"up_to_date": not pending, "pending": pending, "error": None}


# -- runs ------------------------------------------------------------------------------------


def parse_search(q: str, known: list[str]) -> dict[str, Any]:
    """A search box's text as filters: ``key:<key>``, a run id, or a workflow name."""
    q = q.strip()
    if not q:
        return {}
    if q.startswith("key:"):
        return {"key": q[4:]}
    if RUN_ID.match(q):
        return {"run_id": q.lower()}
    if q in known:
        return {"workflow": q}
    return {"key": q}


def runs_page(durable: Durable, params: dict[str, Any]) -> dict[str, Any]:
    """One page of runs by workflow, status, key or search text, newest first."""
    limit, page = check_limit(params.get("limit")), check_page(params.get("page"))
    after = check_after(params.get("after") or None)
    if after is not None:
        page = 1  # a keyset page: the cursor says where it starts
    status = check_status(params.get("status"))
    workflow, key = params.get("workflow") or None, params.get("key") or None
    with durable.db.engine.connect() as conn:
        known = sorted(set(dashboard_rows.workflow_names(conn)) | set(durable.workflows))
        found = parse_search(params.get("q") or "", known)
        if "run_id" in found:
            exists = dashboard_rows.run_exists(conn, found["run_id"])
            return {"run_id": found["run_id"] if exists else None, "runs": [], "workflows": known}
        workflow, key = found.get("workflow", workflow), found.get("key", key)
        extra = filter_of({k: params.get(k) for k in ("key_prefix", "tag", "since", "until", "error_type")})
        rows = dashboard_rows.page_of_runs(
            conn,
            *extra.conditions(durable.db),
            workflow=workflow,
            status=status,
            key=key,
            workflows=known,
            limit=limit + 1,
            after=after,
            offset=(page - 1) * limit,
        )
    more = len(rows) > limit
    return {
        "runs": [_run_row(durable, r) for r in rows[:limit]],
        "more": more,
        "next": rows[limit - 1].id if more else None,  # after= of the next page
        "after": after,
        "page": page,
        "limit": limit,
        "filters": {
            "workflow": workflow,
            "status": status,
            "key": key,
            "q": params.get("q") or "",
            **{k: params.get(k) or "" for k in ("key_prefix", "tag", "since", "until", "error_type")},
        },
        "workflows": known,
    }


def holds_word(durable: Durable, run: Run) -> str:
    """Whether a run holds its key, in the CLI's words: ``yes`` (a new start with the key is
    answered by it), ``free`` (a finished holder whose key the next start takes), ``-``."""
    if not run.holds_key:
        return "-"
    return "yes" if key_blocks(durable.workflows, run.workflow, run.status) else "free"


def _run_row(durable: Durable, row: Any) -> dict[str, Any]:
    """A run of a list, with its step's name and the ``holds`` word."""
    run = Run.from_row(row)
    return dict(asdict(run), step_name=row.step_name, holds=holds_word(durable, run))


def run_detail(durable: Durable, run_id: str) -> dict[str, Any]:
    """A run with its steps, events, pending input, family, activity, key view and what keeps
    it from moving."""
    run = durable.get_run(run_id)
    steps = durable.list_steps(run_id)
    state = why.run_state(durable, run, steps)
    with durable.db.engine.connect() as conn:
        events = [dict(r._mapping) for r in dashboard_rows.events_of_run(conn, run_id)]
        brief = dashboard_rows.run_brief(conn, [run.parent_id or "", run.runs_after_id or ""])
        key = key_view(durable, conn, run)
    return {
        "run": run,
        "steps": [dict(asdict(s), duration=_seconds(s.started_at, s.finished_at)) for s in steps],
        "events": events,
        "waiting_for": state["wait"],
        "children": durable.list_children(run_id, limit=200),
        "parent": brief.get(run.parent_id or ""),
        "runs_after": brief.get(run.runs_after_id or ""),
        "activity": durable.activity(run_id=run_id, limit=100),
        "key": key,
        "state": state,
    }


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else round((end - start).total_seconds(), 3)


def key_view(durable: Durable, conn: Any, run: Run) -> dict[str, Any] | None:
    """The run's key: who holds it, the run waiting behind it, re-adds answered by this run
    (each dropped input as a diff against the run's input), hand-offs and releases."""
    if run.key is None:
        return None
    row = dashboard_rows.key_row(conn, run.workflow, run.key)
    decisions = dashboard_rows.key_decisions_of_run(conn, run.id)
    history = dashboard_rows.key_history(conn, run.workflow, run.key)
    readds = [_readd(run, d) for d in decisions if d.kind == "key_duplicate"]
    waiting_id = row.waiting_id if row is not None else None
    brief = dashboard_rows.run_brief(conn, [waiting_id or ""])
    return {
        "key": run.key,
        "holds": row is not None and row.holder_id == run.id,
        "holds_word": holds_word(durable, run),
        "holder_id": row.holder_id if row is not None else None,
        "holder_status": row.status if row is not None else None,
        "blocks": row is not None and key_blocks(durable.workflows, run.workflow, row.status),
        "waiting": brief.get(waiting_id or ""),
        "waiting_id": waiting_id,
        "runs_after_id": run.runs_after_id,
        "readds": len(readds),
        "readd_entries": readds,
        "dropped": [r for r in readds if r["dropped"]],
        "history": [_entry(h) for h in history],
        "runs": [
            {
                "id": r.id,
                "status": r.status,
                "created_at": aware(r.created_at),
                "finished_at": aware(r.finished_at),
                "holds": row is not None and row.holder_id == r.id,
                "waited_behind": r.runs_after_id,
            }
            for r in dashboard_rows.runs_of_key(conn, run.workflow, run.key, RUNS_OF_KEY)
        ],
        "runs_limit": RUNS_OF_KEY,
    }


def _readd(run: Run, row: Any) -> dict[str, Any]:
    details = row.details or {}
    dropped = details.get("outcome") in ("use_existing", "error") and bool(details.get("input_changed"))
    return {
        "at": aware(row.at),
        "outcome": details.get("outcome"),
        "policy": details.get("policy"),
        "input_changed": bool(details.get("input_changed")),
        "dropped": dropped,
        "input": details.get("input"),
        # A large dropped input is kept as its digest, size and preview (keys.dropped_input).
        "kept_whole": "input" in details,
        "input_digest": details.get("input_digest"),
        "input_bytes": details.get("input_bytes"),
        "input_preview": details.get("input_preview"),
        "diff": input_diff(run.input, details.get("input")) if dropped and "input" in details else [],
    }


def _entry(row: Any) -> dict[str, Any]:
    return {
        "kind": row.kind,
        "run_id": row.run_id,
        "workflow": row.workflow,
        "key": row.key,
        "details": row.details,
        "at": aware(row.at),
    }


def input_diff(base: Any, other: Any) -> list[dict[str, Any]]:
    """Fields where ``other`` differs from ``base``: added, removed or changed."""
    if not isinstance(base, dict) or not isinstance(other, dict):
        return [] if base == other else [{"field": "", "change": "changed", "run": base, "dropped": other}]
    diff = []
    for name in sorted(set(base) | set(other)):
        if name not in base:
            diff.append({"field": name, "change": "added", "run": None, "dropped": other[name]})
        elif name not in other:
            diff.append({"field": name, "change": "removed", "run": base[name], "dropped": None})
        elif base[name] != other[name]:
            diff.append({"field": name, "change": "changed", "run": base[name], "dropped": other[name]})
    return diff


# -- keys ------------------------------------------------------------------------------------


def keys_data(
    durable: Durable, workflow: str | None, prefix: str | None, limit: int = 200, after: str | None = None
) -> dict[str, Any]:
    """A page of key rows (holder, whether it blocks a start, waiting run, re-adds in the last
    day), newest taken first, past the key whose cursor ``after`` is; the keys re-added most
    this week."""
    place = check_key_cursor(after or None)
    now = durable.db.utcnow()
    with durable.db.engine.connect() as conn:
        rows = dashboard_rows.page_of_keys(conn, workflow or None, prefix or None, limit + 1, place)
        pairs = [(r.workflow, r.key) for r in rows[:limit]]
        used = activity_rows.runs_per_key(conn, workflow, pairs)
        readds = dashboard_rows.readds_per_key(conn, pairs, now - timedelta(days=1))
        top = dashboard_rows.top_readded(conn, workflow or None, now - timedelta(days=7))
    entries = key_entries(durable.workflows, rows[:limit], used, readds)
    more = len(rows) > limit
    return {
        "keys": entries,
        "more": more,
        "next": entries[-1].cursor if more else None,  # after= of the next page
        "after": after or None,
        "top": [{"workflow": t.workflow, "key": t.key, "readds": int(t.n)} for t in top],
        "filters": {"workflow": workflow or "", "prefix": prefix or ""},
        "limit": limit,
    }


def workflow_data(durable: Durable, name: str) -> dict[str, Any]:
    """A workflow: its definition (when known here), recent runs and its keys."""
    known = durable.workflows.get(name)
    recent = durable.list_runs(workflow=name, limit=20)
    definition = None if known is None else describe_workflow(durable, known)
    return {"name": name, "definition": definition, "runs": recent, "keys": keys_data(durable, name, None)}


def describe_workflow(durable: Durable, workflow: Any) -> dict[str, Any]:
    """A workflow's options and, per step, its retry, backoff, queue, timeout and compensation."""
    settings, default = durable.settings, durable.runtime.default_queue()
    key, debounce = workflow.key, workflow.debounce
    if key is not None and not isinstance(key, str):
        key = f"computed by {getattr(key, '__name__', 'a function')}()"
    steps = []
    for step in workflow.steps:
        base, most = step.backoff or settings.backoff_base, settings.backoff_max
        backoff = f"{most:g} s (backoff_max)" if base >= most else f"{base:g} s, doubling, at most {most:g} s"
        steps.append(
            {
                "index": step.index,
                "name": step.name,
                "retry": step.retry,
                "backoff": backoff if step.retry > 1 else None,
                "queue": workflow.queue_for(step, default) or default,
                "timeout": step.timeout,
                "compensation": getattr(step.compensate, "__name__", "yes") if step.compensate else None,
                "compensate_retry": step.compensate_retry,
            }
        )
    return {
        "reuse": workflow.reuse,
        "on_duplicate": str(workflow.on_duplicate),
        "key": key,
        "idempotency": workflow.idempotency,
        "timeout": workflow.timeout,
        "debounce": dict(period=debounce["period"], timeout=debounce.get("timeout")) if debounce else None,
        "flow": {
            kind: dict(shown, text=limit_words(kind, shown)) for kind, shown in limits_of(workflow).items()
        },
        "steps": steps,
    }


# -- flow control ------------------------------------------------------------------------------


def flow_data(durable: Durable, workflow: str | None, keys: int = 50) -> dict[str, Any]:
    """The Flow page: per workflow with a flow limit, its limits and each key's use (slots in
    use, runs parked, begins or starts in the window), keys with most runs waiting first; each
    fair key's share and runs waiting; the parked runs per priority; open batches."""
    found = flow_report(durable.runtime, workflow or None, keys)
    return {
        "workflows": [
            {
                "workflow": entry.workflow,
                "limits": {k: dict(v, text=limit_words(k, v)) for k, v in entry.limits.items()},
                "keys": [dict(asdict(k), use=use_words(k), shown_key=key_words(k.key)) for k in entry.keys],
                "fair": [asdict(share) for share in entry.fair],
                "priorities": dict(sorted(entry.priorities.items(), reverse=True)),
                "batches": [dict(asdict(b), shown_key=key_words(b.key)) for b in entry.batches],
            }
            for entry in found
        ],
        "filters": {"workflow": workflow or ""},
        "keys_shown": keys,
    }


# -- queues, schedules, settings ----------------------------------------------------------------


def queues_data(durable: Durable) -> dict[str, Any]:
    """Per queue: counts, paused, its live consumers (flagged when ready runs have none);
    nodes; recoveries and fenced workers of the last day.

    Of a queue's runs neither ready nor running, ``waiting`` counts those of status
    ``waiting`` (on a sleep, an event, an input, children), ``held`` those flow control parks
    and ``later`` the others (a retry's backoff, a debounce, a snooze)."""
    stats = durable.stats.queues()
    db = durable.db
    now = db.utcnow()
    nodes = why.live_nodes(durable, now)
    parked: dict[str, tuple[int, int]] = {}
    with db.engine.connect() as conn:
        for row in flow_reads.held_by_queue(db, conn):
            name = row.queue or durable.runtime.default_queue()  # as queue_stats counts them
            held, waiting = parked.get(name, (0, 0))
            parked[name] = (held + int(row.held or 0), waiting + int(row.waiting or 0))
    queue_list = []
    for name, entry in stats.items():
        consumers = why.consumers(nodes, name)
        no_consumer = entry["ready"] > 0 and not consumers and not entry["paused"]
        held, waiting = parked.get(name, (0, 0))
        split = {"waiting": waiting, "held": held, "later": max(entry["waiting"] - held - waiting, 0)}
        queue_list.append(dict(entry, **split, name=name, consumers=consumers, no_consumer=no_consumer))
    with durable.db.engine.connect() as conn:
        since = now - timedelta(days=1)
        troubles = dashboard_rows.count_activity(conn, dashboard_rows.RECOVERY_KINDS, since)
        recent = [
            _entry(r) for r in dashboard_rows.recent_activity(conn, dashboard_rows.RECOVERY_KINDS, since)
        ]
    return {"queues": queue_list, "nodes": nodes, "recoveries": troubles, "recent": recent}


def schedules_data(durable: Durable) -> dict[str, Any]:
    """Every schedule: key, next fire, last outcome, failures in a row, enabled; the late ones
    (overdue by more than their period) and the beat command that fires them."""
    from ..schedules import beat_command

    try:
        found = durable.list_schedules()
    except Exception as exc:  # e.g. RedBeat's Redis down: the page says so instead of failing
        return {"schedules": [], "late": [], "beat": None, "error": f"{type(exc).__name__}: {exc}"}
    late = [s.name for s in found if s.late]
    return {"schedules": found, "late": late, "beat": beat_command(durable.app), "error": None}


def settings_data(durable: Durable) -> dict[str, Any]:
    """Effective settings (secrets masked), the schema state and the prune rules."""
    shown = {}
    for field in fields(durable.settings):
        shown[field.name] = mask_setting(field.name, getattr(durable.settings, field.name))
    shown["log_capture"] = log_capture_text(durable.runtime.instrumentation.log_capture)
    return {
        "settings": shown,
        "schema": schema_state(durable),
        "prune": dict(durable.settings.prune or {}),
        "prune_interval": durable.settings.prune_interval,
        "database": durable.db.masked_url,
        "broker": masked_url(str(durable.app.conf.broker_url or "")),
    }


def mask_setting(name: str, value: Any) -> Any:
    """A setting as the page may show it: URLs without passwords, secrets as ``***``."""
    if value is None:
        return None
    if any(word in name.lower() for word in SECRET_WORDS):
        return "***"
    if name.endswith("url") and isinstance(value, str):
        return masked_url(value)
    if isinstance(value, (str, int, float, bool, list, dict)):
        return jsonable(value)
    return type(value).__name__


def log_capture_text(capture: Any) -> str:
    """What step log capture keeps, in words: e.g. ``WARNING and above, every metadata field``."""
    if not capture.enabled:
        return "off: no log lines are saved"
    levels = capture.levels
    if levels is None:
        kept = "every level"
    elif levels and set(levels) == {n for n in (10, 20, 30, 40, 50) if n >= min(levels)}:
        kept = f"{logging.getLevelName(min(levels))} and above"
    else:
        kept = ", ".join(logging.getLevelName(n) for n in sorted(levels)) or "no level"
    names = capture.metadata_filter
    metadata = "all metadata" if names is None else f"metadata {', '.join(sorted(names)) or 'none'} only"
    console = "" if capture.console else "; saved lines kept off the console"
    return f"{kept}, {metadata}{console}"


def unfinished(status: str) -> bool:
    """Whether a status is not final."""
    return status in UNFINISHED
