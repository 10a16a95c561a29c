"""``durable doctor`` and ``durable status``: stuck state found, the safe part of it repaired.

Findings (``Finding.kind``):

* ``waiting_unwakeable``: a waiting run with no timer and nothing to wait for (no event name,
  or a sleep without an end). Nothing will ever make it due; cancel or retry it. A
  ``run_again`` run waiting behind its key's holder is not one while the holder is unfinished
  (the holder's end makes it due); it is once the holder finished and it was never made due.
* ``missed_wakeup``: a waiting run whose event is kept for it but which was never made due.
  ``--fix`` makes it due now.
* ``stale_lock``: a run locked by a worker silent for longer than ``stale_lock_timeout``.
  ``--fix`` runs the same sweep as the workers' upkeep (hand it back, or fail it after
  ``max_losses``).
* ``unsent``: a run due for a while whose message was never sent, or was sent and neither
  claimed nor re-sent (no worker's upkeep is running). ``--fix`` runs the outbox relay.
* ``stalled_compensation``: a compensating run nobody holds and that is not due.
* ``orphaned_child``: an unfinished child of a cancelled parent (the cancel's process died
  before it reached every child). ``--fix`` cancels it, as the workers' upkeep does.
* ``disabled_schedule``: a cron schedule turned off; it fires again only once re-enabled.
* ``schedule_missing``: an enabled run-time schedule whose RedBeat entry is gone from Redis (a
  flushed or replaced Redis): nothing fires it. ``--fix`` re-creates the entry from
  ``durable_schedules``, as the workers' upkeep does.
* ``no_consumer``: ready runs on a queue that no live worker node consumes (seen within
  ``stale_lock_timeout``, not draining) and that is not paused: start a worker with ``-Q`` and
  that queue, or have a running one consume it (``celery control add_consumer``). A node's
  queues are its live consumer's, so a ``cancel_consumer`` counts. One finding per queue, with
  the count and the oldest ready time.
* ``schedule_late``: an enabled schedule whose fire is overdue by more than its period plus a
  margin: no beat fires it. Start (or restart) ``celery beat`` with the app's scheduler.
* ``dead_tuples``, ``vacuum_overdue``, ``long_transaction``: PostgreSQL's upkeep falling behind
  (see ``pg_health``); not fixable here.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..models import aware
from ..store import child_rows, doctor_rows, node_rows, observe_rows, queue_rows
from . import pg_health

if TYPE_CHECKING:
    from ..core.runtime import Runtime

log = logging.getLogger("durable_celery")

LIMIT = 1000  # findings per kind
UNSENT_AFTER = 30.0  # seconds a due, never-sent run may wait for the relay before it is a finding
FIXABLE = ("missed_wakeup", "stale_lock", "unsent", "orphaned_child", "schedule_missing")


@dataclass
class Finding:
    """One piece of stuck state: what kind, which run (or schedule), and what to do about it."""

    kind: str
    message: str
    run_id: str | None = None
    workflow: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    fixable: bool = False
    fixed: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The finding as plain JSON-ready values."""
        return asdict(self)


def _run_finding(kind: str, row: Any, message: str, **details: Any) -> Finding:
    return Finding(
        kind=kind,
        message=message,
        run_id=row.id,
        workflow=row.workflow,
        details={"key": row.key, "status": row.status, "step_index": row.step_index, **details},
        fixable=kind in FIXABLE,
    )


def diagnose(rt: Runtime, app: Any) -> list[Finding]:
    """Every finding, without changing anything."""
    db, s = rt.db, rt.settings
    with db.engine.connect() as conn:
        unwakeable = doctor_rows.unwakeable_waiting(conn, LIMIT)
        missed = doctor_rows.missed_wakeups(conn, LIMIT)
        stale = doctor_rows.stale_locks(db, conn, s.stale_lock_timeout, LIMIT)
        unsent = doctor_rows.unsent_due_runs(
            db, conn, max(UNSENT_AFTER, s.poll_interval), s.relay_after, LIMIT
        )
        compensations = doctor_rows.stalled_compensations(conn, LIMIT)
        disabled = observe_rows.disabled_schedules(conn)
        orphans = child_rows.orphans(conn, LIMIT)
        unconsumed = _unconsumed(rt, conn)
        upkeep = pg_health.findings(db, conn)
    found = [
        _run_finding(
            "waiting_unwakeable", r, "waiting with no timer and nothing to wait for", wait=r.wait_name
        )
        for r in unwakeable
    ]
    found += [
        _run_finding("missed_wakeup", r, f"its event {r.wait_name!r} came but it was never woken")
        for r in missed
    ]
    found += [
        _run_finding(
            "stale_lock",
            r,
            f"locked by {r.locked_by}, silent since {_when(r.heartbeat_at)}",
            locked_by=r.locked_by,
            heartbeat_at=_when(r.heartbeat_at),
        )
        for r in stale
    ]
    found += [
        _run_finding(
            "unsent",
            r,
            f"due since {_when(r.due_at)} and {'sent but never claimed' if r.published else 'never sent'}",
            due_at=_when(r.due_at),
        )
        for r in unsent
    ]
    found += [
        _run_finding("stalled_compensation", r, "compensating, but nobody holds it and it is not due")
        for r in compensations
    ]
    found += [
        _run_finding("orphaned_child", r, f"its parent {r.parent_id} was cancelled", parent_id=r.parent_id)
        for r in orphans
    ]
    found += [
        Finding(
            kind="disabled_schedule",
            message=f"schedule {r.name!r} is turned off after {r.failures} failure(s)",
            workflow=r.workflow,
            details={"schedule": r.name, "key": r.key, "last_outcome": r.last_outcome},
        )
        for r in disabled
    ]
    found += [
        Finding(
            kind="no_consumer",
            message=f"{r.ready} ready run(s) on queue {r.queue!r}, which no live worker consumes: "
            f"start a worker with -Q {r.queue} (or `celery control add_consumer {r.queue}`)",
            details={"queue": r.queue, "ready": r.ready, "oldest_ready_at": _when(r.oldest_ready_at)},
        )
        for r in unconsumed
    ]
    found += _missing_schedules(rt, app)
    found += _late_schedules(rt, app)
    found += [Finding(kind=i.kind, message=i.message, details=i.details) for i in upkeep]
    return found


def _missing_schedules(rt: Runtime, app: Any) -> list[Finding]:
    from redis.exceptions import RedisError

    from ..schedules import missing_entries

    try:
        rows = missing_entries(rt, app)
    except RedisError as exc:  # RedBeat's Redis unreachable: the other findings still count
        log.warning("durable doctor: could not check RedBeat entries: %s", exc)
        return []
    return [
        Finding(
            kind="schedule_missing",
            message=f"schedule {r.name!r} has no RedBeat entry: nothing fires it",
            workflow=r.workflow,
            details={"schedule": r.name, "key": r.key},
            fixable=True,
        )
        for r in rows
    ]


def _late_schedules(rt: Runtime, app: Any) -> list[Finding]:
    from redis.exceptions import RedisError

    from ..schedules import beat_command, late_schedules

    try:
        late = late_schedules(rt, app)
    except RedisError as exc:  # RedBeat's Redis unreachable: the other findings still count
        log.warning("durable doctor: could not check schedule fire times: %s", exc)
        return []
    beat = beat_command(app)
    return [
        Finding(
            kind="schedule_late",
            message=f"schedule {s.name!r} ({s.schedule}) should have fired {s.overdue_seconds:.0f}s ago: "
            f"is `{beat}` running?",
            workflow=s.workflow,
            details={
                "schedule": s.name,
                "key": s.key,
                "overdue_seconds": round(s.overdue_seconds, 1),
                "last_fire_at": _when(s.last_fire_at),
                "beat": beat,
            },
        )
        for s in late
    ]


def _unconsumed(rt: Runtime, conn: Any) -> list[Any]:
    """Per queue with ready runs that no live node consumes and that is not paused."""
    db, s = rt.db, rt.settings
    consumed = node_rows.live_queues(db, conn, s.stale_lock_timeout)
    paused = queue_rows.paused_queues(conn)
    return [
        r
        for r in queue_rows.count_by_queue(db, conn)
        if r.ready and r.queue is not None and r.queue not in consumed and r.queue not in paused
    ]


def _when(value: Any) -> str | None:
    value = aware(value)
    return None if value is None else value.isoformat()


def repair(rt: Runtime, app: Any) -> dict[str, int]:
    """The safe repairs: wake missed wake-ups, sweep stale locks, cancel orphaned children,
    relay unsent runs, restore vanished RedBeat entries."""
    from ..core.sweeps import cancel_orphans_once, sweep_stale_once, wake_missed_once
    from ..schedules import restore_schedules_once
    from ..worker.relay import relay_once

    woken = wake_missed_once(rt)
    handed_back, failed = sweep_stale_once(rt)
    orphans = cancel_orphans_once(rt)
    sent = relay_once(rt, app)
    restored = restore_schedules_once(rt, app)
    return {
        "woken": woken,
        "handed_back": len(handed_back),
        "failed": len(failed),
        "cancelled": len(orphans),
        "sent": sent,
        "restored": restored,
    }


def doctor(rt: Runtime, app: Any, fix: bool = False) -> list[Finding]:
    """Find stuck state; with ``fix`` repair what is safe and mark those findings ``fixed``."""
    found = diagnose(rt, app)
    if not fix or not any(f.fixable for f in found):
        return found
    repair(rt, app)
    remaining = {_identity(f) for f in diagnose(rt, app)}
    for finding in found:
        finding.fixed = finding.fixable and _identity(finding) not in remaining
    return found


def _identity(finding: Finding) -> tuple[str, str | None, Any]:
    return finding.kind, finding.run_id, finding.details.get("schedule")


def summary(rt: Runtime) -> dict[str, Any]:
    """Runs per status, the ready backlog and its oldest run, stale locks, nodes, schedules, and
    on PostgreSQL the busy tables' sizes and dead rows."""
    db, s = rt.db, rt.settings
    with db.engine.connect() as conn:
        by_status = {s: n for s, n in observe_rows.status_counts(conn).items() if n}
        ready = observe_rows.ready_by_workflow(db, conn)
        stale = observe_rows.stale_lock_count(db, conn, s.stale_lock_timeout)
        nodes = observe_rows.list_nodes(conn)
        disabled = observe_rows.disabled_schedules(conn)
        per_workflow = observe_rows.unfinished_by_workflow(conn)
        unconsumed = _unconsumed(rt, conn)
        tables = pg_health.table_figures(db, conn)
    now = db.utcnow()
    due = [d for d in (aware(r.oldest) for r in ready) if d is not None]
    oldest = min(due, default=None)
    return {
        "runs": by_status,  # each count stops at runs_counted_to: never a scan of every run
        "runs_counted_to": observe_rows.COUNT_CAP,
        "unfinished_by_workflow": [
            {"workflow": r.workflow, "status": r.status, "runs": r.n} for r in per_workflow
        ],
        "ready": sum(r.ready for r in ready),
        "ready_by_workflow": {r.workflow: r.ready for r in ready},
        "oldest_ready_seconds": None if oldest is None else max(0.0, (now - oldest).total_seconds()),
        "stale_locks": stale,
        "no_consumer": {r.queue: int(r.ready) for r in unconsumed},
        "disabled_schedules": [r.name for r in disabled],
        "nodes": [
            {
                "name": n.name,
                "queues": n.queues,
                "pid": n.pid,
                "draining": n.draining,
                "seen_seconds_ago": max(0.0, (now - aware(n.seen_at)).total_seconds()),  # type: ignore[operator]
            }
            for n in nodes
        ],
        "tables": tables,
    }
