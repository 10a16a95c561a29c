"""Keyed cron schedules: their definitions, where they live, and the public verbs.

A schedule's definition lives where beat reads it: ``app.conf.beat_schedule`` (made with
``durable.beat_entry``) or a RedBeat entry in Redis (made with ``durable.schedule``), so every
beat instance sees it. What every beat and worker shares about it, failures in a row, last
outcome and whether it is switched off, lives in the ``durable_schedules`` table.

A fire is the task ``durable.fire_schedule``; a worker runs it and starts the workflow by name
with the schedule's key, so the workflow's ``on_duplicate`` decides what a fire gets while the
last run still holds the key. A run's outcome is judged at the schedule's next fire: completed
resets the failure count; failed, or not picked up by any worker within
``schedule_pickup_timeout``, counts one; ``schedule_max_failures`` in a row switch it off.

A schedule is *late* when its fire is overdue by more than its period plus ``LATE_MARGIN`` (and
beat's loop interval): two fires missed, so beat is most likely down (``doctor``'s finding
``schedule_late``, ``status``, the dashboard, the gauge ``durable_schedules_late``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery.schedules import ParseException, crontab
from celery.schedules import schedule as every

from ..definition import Workflow
from ..errors import InvalidArgument, KeyTaken, ScheduleNotFound, Unsupported
from ..inputs import check_input
from ..models import aware
from ..store import schedule_rows
from ..store.db import utcnow
from .entries import (
    FIRE_TASK,
    config_entries,
    fire_options,
    redbeat_entries,
    redbeat_entry,
    save_redbeat,
    switch_redbeat,
    uses_durable_scheduler,
    uses_redbeat,
)
from .fires import fire

if TYPE_CHECKING:
    from ..core.runtime import Runtime

log = logging.getLogger("durable_celery")

UNSET: Any = object()

#: Seconds a schedule may be overdue beyond its period (plus beat's loop interval) before it is late.
LATE_MARGIN = 10.0


@dataclass(frozen=True)
class Schedule:
    """One keyed schedule: its definition, where it lives, and its shared state."""

    name: str
    workflow: str
    key: str | None
    schedule: str
    input: dict[str, Any]
    source: str  # "config" (app.conf.beat_schedule), "redbeat" or "database" (state only)
    enabled: bool = True
    failures: int = 0
    last_outcome: str | None = None
    last_run_id: str | None = None
    last_fire_at: datetime | None = None
    next_fire_at: datetime | None = None
    overdue_seconds: float = 0.0  # how long ago its next fire was due (0: not yet due)
    late: bool = False  # overdue by more than its period plus a margin: is beat running?


# -- definitions ------------------------------------------------------------------------------


def parse_schedule(app: Any, value: Any) -> tuple[Any, str]:
    """A Celery schedule and its text from cron text, seconds, a timedelta or a Celery schedule."""
    if isinstance(value, crontab):
        text = " ".join(
            str(getattr(value, f"_orig_{part}"))
            for part in ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        )
        return parse_schedule(app, text)
    if isinstance(value, every):
        value = value.run_every
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, str) and value.startswith("every ") and value.endswith("s"):
        with contextlib.suppress(ValueError):
            value = float(value[6:-1])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (value > 0 and math.isfinite(value)):
            raise InvalidArgument(f"a schedule interval must be positive seconds, not {value!r}")
        return every(timedelta(seconds=value), app=app), f"every {float(value):g}s"
    if not isinstance(value, str) or len(value.split()) != 5:
        raise InvalidArgument(
            f"a schedule is cron text of five fields ('*/5 * * * *'), seconds or a crontab, not {value!r}"
        )
    minute, hour, day_of_month, month_of_year, day_of_week = value.split()
    try:
        cron = crontab(minute, hour, day_of_week, day_of_month, month_of_year, app=app)
    except (ValueError, TypeError, ParseException) as exc:
        raise InvalidArgument(f"bad cron text {value!r}: {exc}") from exc
    return cron, " ".join(value.split())


def _policy(wf: Workflow) -> dict[str, Any]:
    """What a fire needs to know of its workflow, also on a worker without its code."""
    on_duplicate = wf.on_duplicate
    return {
        "reuse": wf.reuse,
        "on_duplicate": on_duplicate if isinstance(on_duplicate, str) else {"event": on_duplicate.name},
        "timeout": wf.timeout,
        # Fires go where the first step goes: its workers are the ones with the workflow's code.
        "queue": wf.queue_for(wf.steps[0], None) if wf.steps else None,
    }


def _definition(
    rt: Runtime, app: Any, workflow: Any, cron: Any, key: Any, input: Any, name: Any
) -> tuple[Any, dict[str, Any]]:
    """Check a schedule's parts (nothing written) and return (Celery schedule, fire kwargs)."""
    wf = rt.registry.resolve(workflow)
    data = check_input(input, rt.settings.max_input_bytes)
    wf.check_fits(data)  # a fire would be refused: refuse the schedule now
    run_key = wf.derive_key(data, key)
    sched, text = parse_schedule(app, cron)
    if name is None:
        name = wf.name if run_key is None else f"{wf.name}:{run_key}"
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise InvalidArgument(f"a schedule name must be a non-empty str of at most 200 chars, not {name!r}")
    kwargs = {
        "name": name,
        "workflow": wf.name,
        "key": run_key,
        "input": data,
        "schedule": text,
        "policy": _policy(wf),
    }
    return sched, kwargs


def beat_entry(
    rt: Runtime, app: Any, workflow: Any, cron: Any, key: Any = None, input: Any = None, name: Any = None
) -> dict[str, Any]:
    """An ``app.conf.beat_schedule`` entry whose fires start ``workflow`` with ``key``."""
    sched, kwargs = _definition(rt, app, workflow, cron, key, input, name)
    return {"task": FIRE_TASK, "schedule": sched, "kwargs": kwargs, "options": fire_options(sched, kwargs)}


def _row_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: kwargs[k] for k in ("name", "workflow", "key", "schedule", "input")}


def runtime_kwargs(rt: Runtime, app: Any, row: Any) -> tuple[Any, dict[str, Any], dict[str, Any]] | None:
    """(Celery schedule, fire kwargs, message options) of a schedule kept in the database."""
    try:
        sched, text = parse_schedule(app, row.schedule)
    except InvalidArgument:
        return None
    wf = rt.registry.workflows.get(row.workflow)
    kwargs = {
        "name": row.name,
        "workflow": row.workflow,
        "key": row.key,
        "input": row.input or {},
        "schedule": text,
        "policy": _policy(wf) if wf is not None else None,
    }
    return sched, kwargs, fire_options(sched, kwargs)


def missing_entries(rt: Runtime, app: Any) -> list[Any]:
    """Rows of enabled run-time schedules whose RedBeat entry is gone (a flushed or replaced
    Redis): beat no longer fires them though ``durable_schedules`` still holds them."""
    if not uses_redbeat(app):
        return []
    from redbeat.schedulers import RedBeatSchedulerEntry, ensure_conf, get_redis

    conf = ensure_conf(app)
    configured = config_entries(app)
    with rt.db.engine.connect() as conn:
        rows = [r for r in schedule_rows.fetch_schedules(conn) if r.enabled and r.name not in configured]
    if not rows:
        return []
    with get_redis(app).pipeline() as pipe:  # one round trip: is each entry there, and scheduled?
        for row in rows:
            key = RedBeatSchedulerEntry.generate_key(app, row.name)
            pipe.hexists(key, "definition")
            pipe.zscore(conf.schedule_key, key)
        found = pipe.execute()
    gone = [r for i, r in enumerate(rows) if not found[2 * i] or found[2 * i + 1] is None]
    if gone:  # a beat_schedule entry RedBeat keeps under its beat_schedule name is not run-time
        stored = redbeat_entries(app)
        gone = [r for r in gone if r.name not in stored or stored[r.name].name == r.name]
    return gone


def restore_schedules_once(rt: Runtime, app: Any) -> int:
    """Re-create the RedBeat entries of enabled run-time schedules from ``durable_schedules``;
    how many. An entry counts from the schedule's last fire, so a slot missed while it was gone
    fires once, at once, not once per slot."""
    from redbeat.schedulers import RedBeatSchedulerEntry

    restored = 0
    for row in missing_entries(rt, app):
        built = runtime_kwargs(rt, app, row)
        if built is None:
            continue
        sched, kwargs, options = built
        entry = redbeat_entry(app, row.name)
        if entry is None:
            entry = RedBeatSchedulerEntry(
                row.name,
                FIRE_TASK,
                sched,
                kwargs=kwargs,
                options=options,
                last_run_at=aware(row.last_fire_at or row.created_at),
                enabled=True,
                app=app,
            )
        entry.save()  # also puts an entry that lost only its place in the schedule back in it
        log.warning("durable: restored the RedBeat entry of schedule %r from the database", row.name)
        restored += 1
    return restored


# -- the public verbs ---------------------------------------------------------------------------


def create(rt: Runtime, app: Any, workflow: Any, cron: Any, key: Any, input: Any, name: Any) -> Schedule:
    """Create (or redefine) a schedule at run time: a RedBeat entry, or a row DurableScheduler reads."""
    sched, kwargs = _definition(rt, app, workflow, cron, key, input, name)
    name = kwargs["name"]
    config = config_entries(app)
    if name in config or name in {e["conf_name"] for e in config.values()}:
        raise InvalidArgument(f"schedule {name!r} is defined in app.conf.beat_schedule")
    redbeat = uses_redbeat(app)
    if not redbeat and not uses_durable_scheduler(app):
        raise Unsupported(
            "run-time schedules need RedBeat (set app.conf.redbeat_redis_url and run "
            "`celery beat -S redbeat.RedBeatScheduler`) or, without Redis, "
            'app.conf.beat_scheduler = "durable_celery.beat:DurableScheduler"'
        )
    with rt.db.begin() as conn:
        schedule_rows.upsert_schedule_txn(rt.db, conn, _row_values(kwargs), replace=True)
        row = schedule_rows.fetch_schedule(conn, name)
        if redbeat:  # written last, inside the transaction: a Redis error writes nothing
            save_redbeat(app, name, sched, kwargs, row.enabled)
    return get(rt, app, name)


def _refuse_configured(rt: Runtime, app: Any, name: str, change: str) -> None:
    """Configured schedules change in the configuration, also where RedBeat stored a copy."""
    config = config_entries(app)
    configured = name in config or name in {e["conf_name"] for e in config.values()}
    if not configured and uses_redbeat(app) and redbeat_entry(app, name) is None:
        configured = name in redbeat_entries(app)  # stored by beat under its beat_schedule name
    if configured:
        raise InvalidArgument(f"schedule {name!r} is defined in app.conf.beat_schedule; {change} it there")


def update(rt: Runtime, app: Any, name: str, cron: Any, workflow: Any, key: Any, input: Any) -> Schedule:
    """Change parts of a run-time schedule; the next fire uses them."""
    _refuse_configured(rt, app, name, "change")
    current = get(rt, app, name)
    sched, kwargs = _definition(
        rt,
        app,
        current.workflow if workflow is UNSET else workflow,
        current.schedule if cron is UNSET else cron,
        current.key if key is UNSET else key,
        current.input if input is UNSET else input,
        name,
    )
    with rt.db.begin() as conn:
        values = _row_values(kwargs)
        del values["name"]
        schedule_rows.update_definition_txn(rt.db, conn, name, values)
        if uses_redbeat(app):
            save_redbeat(app, name, sched, kwargs, current.enabled)
    return get(rt, app, name)


def switch(rt: Runtime, app: Any, name: str, enabled: bool) -> Schedule:
    """Enable (failure count back to 0) or disable a schedule."""
    current = get(rt, app, name)
    _ensure_row(rt, current)
    with rt.db.begin() as conn:
        schedule_rows.set_enabled_txn(rt.db, conn, name, enabled)
    switch_redbeat(app, name, enabled)
    return get(rt, app, name)


def remove(rt: Runtime, app: Any, name: str) -> bool:
    """Delete a run-time schedule and its state; False if there was none."""
    _refuse_configured(rt, app, name, "remove")
    entry = redbeat_entry(app, name) if uses_redbeat(app) else None
    if entry is not None:
        entry.delete()
    with rt.db.begin() as conn:
        deleted = schedule_rows.delete_schedule_txn(conn, name)
    return deleted or entry is not None


def list_all(rt: Runtime, app: Any, rows: Sequence[Any] | None = None) -> list[Schedule]:
    """Every schedule: config entries, RedBeat entries and rows (those given, or read), by name."""
    config, redbeat = config_entries(app), redbeat_entries(app)
    if rows is None:
        with rt.db.engine.connect() as conn:
            rows = schedule_rows.fetch_schedules(conn)
    by_name = {r.name: r for r in rows}
    names = sorted(set(config) | set(redbeat) | set(by_name))
    return [_describe(app, n, config.get(n), redbeat.get(n), by_name.get(n)) for n in names]


def get(rt: Runtime, app: Any, name: str) -> Schedule:
    """One schedule by name (or by its ``beat_schedule`` key); ScheduleNotFound if none."""
    if not isinstance(name, str):
        raise ScheduleNotFound(name)
    config = config_entries(app)
    by_conf_name = {e["conf_name"]: n for n, e in config.items()}
    name = name if name in config else by_conf_name.get(name, name)
    entry = redbeat_entry(app, name) if uses_redbeat(app) else None
    if entry is not None and entry.task != FIRE_TASK:
        entry = None
    if entry is not None:  # a beat_schedule entry RedBeat stored under its beat_schedule name
        name = (entry.kwargs or {}).get("name") or name
    elif uses_redbeat(app) and name not in config:
        entry = redbeat_entries(app).get(name)
    with rt.db.engine.connect() as conn:
        row = schedule_rows.fetch_schedule(conn, name)
    if config.get(name) is None and entry is None and row is None:
        raise ScheduleNotFound(name)
    return _describe(app, name, config.get(name), entry, row)


def _describe(app: Any, name: str, config: Any, entry: Any, row: Any) -> Schedule:
    if config is not None:
        kwargs, source = config["kwargs"], "config"
    elif entry is not None:
        kwargs, source = dict(entry.kwargs or {}), "redbeat"
    else:
        kwargs, source = {c: getattr(row, c) for c in ("workflow", "key", "schedule", "input")}, "database"
    state: dict[str, Any] = {}
    if row is not None:
        state = {
            "enabled": row.enabled,
            "failures": row.failures,
            "last_outcome": row.last_outcome,
            "last_run_id": row.last_run_id,
            "last_fire_at": aware(row.last_fire_at),
        }
    enabled = state.get("enabled", True) and (entry is None or entry.enabled)
    timing = _timing(app, kwargs, entry, row) if enabled else {"next_fire_at": None}
    return Schedule(
        name=name,
        workflow=kwargs["workflow"],
        key=kwargs.get("key"),
        schedule=kwargs.get("schedule") or "",
        input=kwargs.get("input") or {},
        source=source,
        **{**state, "enabled": enabled},
        **timing,
    )


def _timing(app: Any, kwargs: dict[str, Any], entry: Any, row: Any) -> dict[str, Any]:
    """The next fire (now if overdue), how long it is overdue, and whether that makes it late."""
    # Not RedBeat's entry.due_at: it adds the time left *from now* to last_run_at, which is early
    # by however long ago the last fire was (a restored entry could show a next fire in the past).
    if entry is not None:
        sched, last = entry.schedule, entry.last_run_at
    else:
        try:
            sched, _ = parse_schedule(app, kwargs.get("schedule"))
        except InvalidArgument:
            return {"next_fire_at": None}
        last = None if row is None else row.last_fire_at or row.created_at
    now = utcnow()
    if last is None:  # never fired, and nothing tells since when it is due
        return {"next_fire_at": now}
    left = sched.remaining_estimate(aware(last))
    if left is None:
        return {"next_fire_at": None}
    overdue = max(0.0, -left.total_seconds())
    margin = LATE_MARGIN + float(app.conf.get("beat_max_loop_interval") or 0)
    late = overdue > 0 and overdue > period_of(sched, now + left) + margin
    return {"next_fire_at": max(now, now + left), "overdue_seconds": overdue, "late": late}


def period_of(sched: Any, due: datetime) -> float:
    """Seconds from the fire due at ``due`` to the one after it."""
    if isinstance(sched, every):
        return float(sched.run_every.total_seconds())
    # A cron slot is a whole minute: the slot after the one due is found from a second past it.
    following = sched.remaining_estimate(due + timedelta(seconds=1))
    return 0.0 if following is None else (utcnow() + following - due).total_seconds()


def late_schedules(rt: Runtime, app: Any, rows: Sequence[Any] | None = None) -> list[Schedule]:
    """Enabled schedules overdue by more than their period plus a margin (beat is not firing);
    ``rows``: the ``durable_schedules`` rows when already read."""
    return [s for s in list_all(rt, app, rows) if s.late]


def beat_command(app: Any) -> str:
    """The ``celery beat`` command line that fires this app's schedules."""
    if uses_redbeat(app):
        return "celery beat -S redbeat.RedBeatScheduler"
    if uses_durable_scheduler(app):
        return "celery beat -S durable_celery.beat:DurableScheduler"
    return "celery beat"


def _ensure_row(rt: Runtime, schedule: Schedule) -> None:
    values = {c: getattr(schedule, c) for c in ("name", "workflow", "key", "schedule", "input")}
    with rt.db.begin() as conn:
        schedule_rows.upsert_schedule_txn(rt.db, conn, values, replace=False)


def trigger(rt: Runtime, app: Any, name: str) -> str:
    """Fire a schedule now, with its key: the run id started, or the holder's id."""
    current = get(rt, app, name)
    if not current.enabled:
        raise InvalidArgument(f"schedule {current.name!r} is disabled; enable it first")
    wf = rt.registry.workflows.get(current.workflow)
    result = fire(
        rt,
        app,
        name=current.name,
        workflow=current.workflow,
        key=current.key,
        input=current.input,
        schedule=current.schedule,
        policy=_policy(wf) if wf is not None else None,
        manual=True,
    )
    if result["outcome"] == "skipped":
        raise KeyTaken(result["run_id"])
    if result["outcome"] == "rate_limited":
        raise result["refusal"]
    if result["outcome"] == "error":
        raise InvalidArgument(f"schedule {current.name!r} could not start: {result['error']}")
    if result["outcome"] == "disabled":
        raise InvalidArgument(f"schedule {current.name!r} is disabled; enable it first")
    if result["run_id"] is None:  # this fire judged the last failure in a row
        raise InvalidArgument(f"schedule {current.name!r} is now disabled: its last run {result['outcome']}")
    return str(result["run_id"])


def problems(rt: Runtime) -> list[str]:
    """What ``doctor`` reports about schedules: those switched off after repeated failures."""
    with rt.db.engine.connect() as conn:
        rows = schedule_rows.disabled_schedules(conn)
    return [
        f"schedule {r.name!r} ({r.workflow}) is disabled after {r.failures} failure(s) in a row "
        f"(last: {r.last_outcome}); fix it, then `durable.enable_schedule({r.name!r})`"
        for r in rows
        if r.failures >= rt.settings.schedule_max_failures
    ]
