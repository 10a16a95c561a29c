"""Retention: delete finished runs past their age, in batches, by the configured rules or ad hoc.

A run's steps, events and inputs (events) go with it, and so does its key row: a pruned holder's
key is free again. Unfinished runs are never touched: only finished statuses reach the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument
from ..settings import RULES, format_duration, parse_duration
from ..store import activity_rows, prune_rows
from ..store.schema import FINISHED

if TYPE_CHECKING:
    from ..store.db import Database

log = logging.getLogger("durable_celery")

# Runs per batch: each batch is one transaction holding its runs (and their key rows) locked,
# about 0.4 s at this size on a 2-core VM; bigger batches spend less per run (bench/prune.py).
BATCH = 20_000
Progress = Callable[[str], None]


def check_statuses(statuses: Iterable[str] | str | None) -> tuple[str, ...]:
    """Finished status names for an ad-hoc cleanup (all of them when none are given)."""
    if statuses is None:
        return FINISHED
    chosen = (statuses,) if isinstance(statuses, str) else tuple(statuses)
    if not chosen:
        return FINISHED
    for status in chosen:
        if status not in FINISHED:
            why = "is unfinished and never pruned" if isinstance(status, str) and status else "is unknown"
            raise InvalidArgument(f"status {status!r} {why}; choose from {', '.join(FINISHED)}")
    return tuple(dict.fromkeys(chosen))


def _delete_batches(
    db: Database,
    statuses: tuple[str, ...],
    age: timedelta,
    label: str,
    progress: Progress | None,
    max_batches: int | None = None,
) -> tuple[int, bool]:
    """Delete in batches of BATCH until a batch comes back short (or ``max_batches`` ran); one
    activity entry per batch. Returns the runs deleted and whether more may be left."""
    total, batches = 0, 0
    while True:
        with db.begin() as conn:
            n, picked = prune_rows.delete_finished_batch_txn(db, conn, statuses, age.total_seconds(), BATCH)
            if n:
                details = {
                    "rule": label,
                    "statuses": list(statuses),
                    "older_than": age.total_seconds(),
                    "runs": n,
                }
                activity_rows.record_txn(db, conn, "runs_pruned", None, None, None, details)
        total += n
        if progress is not None and n:
            progress(f"{label}: deleted {total} run(s) so far")
        if picked < BATCH or n == 0:  # the rest is younger, or busy until a later pass
            return total, False
        batches += 1
        if max_batches is not None and batches >= max_batches:
            return total, True


def prune(db: Database, rules: Mapping[str, Any] | None, progress: Progress | None = None) -> dict[str, int]:
    """Run the ``prune=`` rules now; returns runs deleted per rule ({} when off)."""
    counts, _ = _prune(db, rules, progress, None)
    return counts


def prune_some(db: Database, rules: Mapping[str, Any] | None) -> bool:
    """One batch per ``prune=`` rule, as the workers' upkeep runs it between its other passes;
    True while more may be left (upkeep then comes back at its next pass, not in an hour)."""
    _, more = _prune(db, rules, None, 1)
    return more


def _prune(
    db: Database, rules: Mapping[str, Any] | None, progress: Progress | None, max_batches: int | None
) -> tuple[dict[str, int], bool]:
    counts, more = {}, False
    for name, age in (rules or {}).items():
        counts[name], left = _delete_batches(db, RULES[name], age, name, progress, max_batches)
        more = more or left
    if any(counts.values()):
        log.info("durable: pruned %s", ", ".join(f"{n} {k}" for k, n in counts.items()))
    return counts, more


def cleanup(
    db: Database,
    older_than: Any,
    statuses: Iterable[str] | str | None = None,
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> dict[str, int]:
    """Delete finished runs older than ``older_than`` in ``statuses`` (default every finished one).

    Returns counts of runs, steps and events: deleted, or with ``dry_run`` what would be.
    """
    age = parse_duration(older_than, "older_than")
    chosen = check_statuses(statuses)
    with db.engine.connect() as conn:
        found = prune_rows.count_finished(db, conn, chosen, age.total_seconds())
    if progress is not None:
        verb = "would delete" if dry_run else "deleting"
        progress(
            f"{verb} {found['runs']} run(s) with {found['steps']} step row(s) and {found['events']} "
            f"event(s): {', '.join(chosen)}, finished over {format_duration(age)} ago"
        )
    if dry_run:
        return found
    deleted, _ = _delete_batches(db, chosen, age, "cleanup", progress)
    return {**found, "runs": deleted}
