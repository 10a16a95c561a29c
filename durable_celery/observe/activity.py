"""Watching: activity entries, the key list, a run's steps and key statistics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from ..core.sweeps import ACTIVITY_KEPT
from ..errors import InvalidArgument, RunNotFound
from ..models import StepRecord, aware
from ..paging import check_after_id, check_key_cursor, check_limit, key_cursor
from ..store import activity_rows, dashboard_rows, key_rows, queries
from ..store.bounded import COUNT_CAP
from ..store.schema import FINISHED, UNFINISHED

if TYPE_CHECKING:
    from ..core.runtime import Runtime
    from ..definition import Workflow


@dataclass(frozen=True)
class Activity:
    """One thing that happened: ``kind``, on which run, with ``details``."""

    id: int
    kind: str
    run_id: str | None
    workflow: str | None
    details: dict[str, Any]
    at: datetime
    key: str | None = None  # the run's key, on entries about a keyed run


@dataclass(frozen=True)
class KeyEntry:
    """A key row: its holder, whether it blocks a new start, runs that used it, re-adds in the
    last day."""

    workflow: str
    key: str
    holder_id: str
    holder_status: str
    waiting_id: str | None
    runs: int
    readds_last_day: int
    # True while a new start with this key is answered by the holder: it is unfinished, or
    # finished under a ``reuse`` that keeps the key. False: the next start takes the key.
    blocks: bool = True
    # When the holder took the key (UTC); the order of the key list.
    taken_at: datetime | None = None

    @property
    def cursor(self) -> str | None:
        """Where the next page starts: ``list_keys(..., after=entry.cursor)`` of the last entry."""
        return None if self.taken_at is None else key_cursor(self.taken_at, self.workflow, self.key)


def _check_limit(limit: Any) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgument(f"limit must be a positive int, not {limit!r}")
    return limit


def list_activity(
    rt: Runtime,
    kinds: Any = None,
    run_id: str | None = None,
    workflow: str | None = None,
    limit: int = 100,
    *,
    after: int | None = None,
) -> list[Activity]:
    """Activity entries, newest first; ``after``: past the entry with that id (keyset)."""
    if isinstance(kinds, str):
        kinds = [kinds]
    after = check_after_id(after)
    with rt.db.engine.connect() as conn:
        rows = activity_rows.list_activity(conn, kinds, run_id, workflow, _check_limit(limit), after)
    return [Activity(r.id, r.kind, r.run_id, r.workflow, r.details, aware(r.at) or r.at, r.key) for r in rows]


def list_keys(
    rt: Runtime,
    workflow: str | None = None,
    limit: int = 1000,
    *,
    prefix: str | None = None,
    after: str | None = None,
) -> list[KeyEntry]:
    """Held keys with their holder, whether they block a new start, runs per key and re-adds
    in the last day, newest taken first; ``prefix`` keeps keys that start with it; ``after``:
    the next page, past the key whose ``cursor`` it is (keyset)."""
    if prefix is not None and not isinstance(prefix, str):
        raise InvalidArgument(f"prefix must be a str, not {prefix!r}")
    limit, place = _check_limit(limit), check_key_cursor(after)
    since = rt.db.utcnow() - timedelta(days=1)
    with rt.db.engine.connect() as conn:
        held = key_rows.list_keys(conn, workflow, limit, prefix, place)
        pairs = [(r.workflow, r.key) for r in held]
        used = activity_rows.runs_per_key(conn, workflow, pairs)
        readds = dashboard_rows.readds_per_key(conn, pairs, since)  # the listed keys' only
    return key_entries(rt.registry.workflows, held, used, readds)


def key_entries(
    workflows: Mapping[str, Workflow], rows: Any, used: Mapping[Any, int], readds: Mapping[Any, int]
) -> list[KeyEntry]:
    """KeyEntry of each key row (workflow, key, holder_id, status, waiting_id, taken_at), with
    its runs and re-adds by (workflow, key)."""
    return [
        KeyEntry(
            r.workflow,
            r.key,
            r.holder_id,
            r.status,
            r.waiting_id,
            used.get((r.workflow, r.key), 0),
            readds.get((r.workflow, r.key), 0),
            key_blocks(workflows, r.workflow, r.status),
            aware(r.taken_at),
        )
        for r in rows
    ]


def list_steps(
    rt: Runtime, run_id: str, limit: int | None = None, *, after: int | None = None
) -> list[StepRecord]:
    """A run's recorded step attempts in order (by id), ``limit`` of them past the step with id
    ``after`` (keyset); RunNotFound if there is no run."""
    limit, after = None if limit is None else check_limit(limit), check_after_id(after)
    with rt.db.engine.connect() as conn:
        run = queries.fetch_run(conn, run_id) if isinstance(run_id, str) else None
        if run is None:
            raise RunNotFound(run_id)
        rows = queries.fetch_steps(conn, run_id, limit, after)
    return [StepRecord.from_row(r, run.input) for r in rows]


def key_blocks(workflows: Mapping[str, Workflow], workflow: str, holder_status: str) -> bool:
    """Whether a key whose holder has ``holder_status`` answers a new start of ``workflow``
    (an unfinished holder always does; a finished one by the workflow's ``reuse``)."""
    from ..core.keys import reuse_frees

    if holder_status in UNFINISHED:
        return True
    known = workflows.get(workflow)
    return not reuse_frees(known.reuse if known is not None else "after_close", holder_status)


@dataclass(frozen=True)
class PendingInput:
    """A run waiting for an input: give it with ``durable.provide_input(run_id, name, value)``."""

    run_id: str
    workflow: str
    name: str
    key: str | None
    until: datetime | None


def list_pending_inputs(rt: Runtime, workflow: str | None = None, limit: int = 100) -> list[PendingInput]:
    """Runs waiting for an input, oldest first."""
    from ..core.waits import INPUT
    from ..store import queries

    with rt.db.engine.connect() as conn:
        rows = queries.pending_inputs(conn, INPUT, _check_limit(limit), workflow)
    return [
        PendingInput(r.id, r.workflow, r.wait_name[len(INPUT) :], r.key, aware(r.wait_until)) for r in rows
    ]


# The newest re-adds the key statistics break down by outcome and key.
READDS_BROKEN_DOWN = 1000


class Stats:
    """Aggregates for dashboards and alerts: ``durable.stats.keys(workflow=...)``."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def keys(self, workflow: str | None = None) -> dict[str, Any]:
        """Keys held and how many of them block a new start, re-adds by outcome, dropped inputs,
        hand-offs, re-adds per hour of the last day, and the keys re-added most (over the week
        activity is kept). Every count stops past ``count_cap`` (``capped``: one did; read
        "10,000+"); the breakdown by outcome and key covers the newest ``breakdown_of`` re-adds
        (at most ``READDS_BROKEN_DOWN``): the report reads the same few rows at any volume."""
        now, cap = self.rt.db.utcnow(), COUNT_CAP
        since = now - ACTIVITY_KEPT
        with self.rt.db.engine.connect() as conn:
            held = key_rows.count_keys(conn, workflow, cap)
            blocking = self._blocking(conn, workflow, cap)
            counts = activity_rows.key_counts(conn, workflow, since, cap)
            hourly = activity_rows.readds_per_hour(conn, workflow, now - timedelta(days=1), cap)
            newest = activity_rows.newest_readds(conn, workflow, since, READDS_BROKEN_DOWN)
        top = Counter((e.workflow, e.key) for e in newest)
        shown = {kind: min(n, cap) for kind, n in counts.items()}
        return {
            "keys_held": min(held, cap),
            "blocking": min(blocking, cap),
            "readds": shown["key_duplicate"],
            "readds_by_outcome": dict(Counter(e.outcome for e in newest)),
            "dropped_inputs": sum(
                1 for e in newest if e.outcome in ("use_existing", "error") and e.input_changed
            ),
            "handoffs": shown["key_handed_off"],
            "releases": shown["key_released"],
            "retakes": shown["key_retaken"],
            "readds_over_time": [
                {"hour": datetime.fromtimestamp(hour * 3600, timezone.utc), "count": n}
                for hour, n in sorted(hourly.items())
            ],
            "top_keys": [
                {"workflow": w, "key": k, "readds": n}
                for (w, k), n in sorted(top.items(), key=lambda item: (-item[1], item[0][1] or ""))[:10]
            ],
            "breakdown_of": len(newest),
            "count_cap": cap,
            "capped": held > cap or blocking > cap or any(n > cap for n in counts.values()),
        }

    def _blocking(self, conn: Any, workflow: str | None, cap: int) -> int:
        """Keys a new start cannot take: those of unfinished holders, and of finished holders
        whose workflow's ``reuse`` keeps the key (``never``: every key of the workflow not held
        by an unfinished run, counted from the keys' index alone), up to about ``cap``."""
        unfinished = {row.workflow: int(row.n) for row in key_rows.keys_of_unfinished(conn, workflow)}
        blocking = sum(unfinished.values())
        for name, statuses in self._finished_blocking(workflow):
            if set(statuses) == set(FINISHED):
                blocking += max(key_rows.count_keys(conn, name, cap) - unfinished.get(name, 0), 0)
            else:
                blocking += key_rows.count_finished_holders(conn, name, statuses, cap)
        return blocking

    def _finished_blocking(self, workflow: str | None) -> list[tuple[str, tuple[str, ...]]]:
        """Per workflow defined here whose ``reuse`` keeps a finished holder's key, the final
        statuses that keep it (``never``: all; ``after_failure``: those not failed-like)."""
        from ..core.keys import reuse_frees

        found = []
        for name, known in self.rt.registry.workflows.items():
            if workflow is not None and name != workflow:
                continue
            statuses = tuple(s for s in FINISHED if not reuse_frees(known.reuse, s))
            if statuses:
                found.append((name, statuses))
        return found

    def queues(self) -> dict[str, dict[str, Any]]:
        """Per queue: ``ready``, ``running``, ``waiting`` runs, ``oldest_ready_at``, ``paused``."""
        from ..core.queues import queue_stats

        return queue_stats(self.rt)
