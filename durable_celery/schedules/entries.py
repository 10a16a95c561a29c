"""Where a schedule's definition lives: an ``app.conf.beat_schedule`` entry or a RedBeat entry in
Redis, each firing the task ``durable.fire_schedule`` (``FIRE_TASK``) with the message options
of ``fire_options``."""

from __future__ import annotations

from typing import Any

from celery.schedules import schedule as every

FIRE_TASK = "durable.fire_schedule"


def fire_options(sched: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Message options of a fire: the queue of its workflow's first step, what Flower shows as
    its arguments (not the input), and for an interval an expiry when the next fire is due (at
    least 10 s), so workers back from an outage don't work through a backlog of stale fires."""
    shown = f"{{schedule: {kwargs['name']}, workflow: {kwargs['workflow']}, key: {kwargs['key']!r}}}"
    options: dict[str, Any] = {"argsrepr": "()", "kwargsrepr": shown}
    queue = (kwargs.get("policy") or {}).get("queue")
    if queue:
        options["queue"] = queue
    if isinstance(sched, every):
        options["expires"] = max(sched.run_every.total_seconds(), 10.0)
    return options


def uses_redbeat(app: Any) -> bool:
    """Is this app configured for RedBeat (``redbeat_redis_url`` or a RedBeat ``beat_scheduler``)?"""
    return bool(app.conf.get("redbeat_redis_url")) or "redbeat" in str(app.conf.get("beat_scheduler") or "")


def uses_durable_scheduler(app: Any) -> bool:
    """Is ``beat_scheduler`` the DurableScheduler (run-time schedules kept in the database)?"""
    return "DurableScheduler" in str(app.conf.get("beat_scheduler") or "")


def config_entries(app: Any) -> dict[str, dict[str, Any]]:
    """Durable entries of ``app.conf.beat_schedule`` by schedule name (their ``name`` kwarg)."""
    found = {}
    for conf_name, entry in (app.conf.beat_schedule or {}).items():
        if isinstance(entry, dict) and entry.get("task") == FIRE_TASK:
            kwargs = dict(entry.get("kwargs") or {})
            found[kwargs.get("name") or conf_name] = {**entry, "kwargs": kwargs, "conf_name": conf_name}
    return found


def redbeat_entries(app: Any) -> dict[str, Any]:
    """Durable RedBeat entries stored in Redis, by schedule name."""
    if not uses_redbeat(app):
        return {}
    from redbeat.schedulers import RedBeatSchedulerEntry, ensure_conf, get_redis

    conf = ensure_conf(app)
    found = {}
    for redis_key in get_redis(app).zrange(conf.schedule_key, 0, -1):
        try:
            entry = RedBeatSchedulerEntry.from_key(redis_key, app=app)
        except KeyError:
            continue
        if entry.task == FIRE_TASK:
            found[(entry.kwargs or {}).get("name") or entry.name] = entry
    return found


def redbeat_entry(app: Any, name: str) -> Any:
    """The RedBeat entry stored under ``name``, or None."""
    from redbeat.schedulers import RedBeatSchedulerEntry, ensure_conf

    ensure_conf(app)
    try:
        return RedBeatSchedulerEntry.from_key(RedBeatSchedulerEntry.generate_key(app, name), app=app)
    except KeyError:
        return None


def save_redbeat(app: Any, name: str, sched: Any, kwargs: dict[str, Any], enabled: bool) -> None:
    from redbeat.schedulers import RedBeatSchedulerEntry

    entry = redbeat_entry(app, name)
    if entry is None:
        # A new entry counts from now: its first fire is its first slot, not at once.
        entry = RedBeatSchedulerEntry(
            name,
            FIRE_TASK,
            sched,
            kwargs=kwargs,
            options=fire_options(sched, kwargs),
            enabled=enabled,
            app=app,
        )
    else:
        entry.schedule, entry.kwargs, entry.enabled = sched, kwargs, enabled
        entry.options = fire_options(sched, kwargs)
    entry.save()


def switch_redbeat(app: Any, name: str, enabled: bool) -> None:
    """Enable or disable the RedBeat entry of a run-time schedule, if RedBeat keeps one."""
    entry = redbeat_entry(app, name) if uses_redbeat(app) else None
    if entry is not None and entry.enabled != enabled:
        entry.enabled = enabled
        entry.save()
