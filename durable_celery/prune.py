"""Retention: delete finished runs past their age, in batches, by the configured rules or ad hoc.

A run's steps, events and inputs (events) go with it, and so does its key row: a pruned holder's
key is free again. Unfinished runs are never touched: only finished statuses reach the store.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgument, InvalidDefinition
from .store import activity_rows, prune_rows
from .store.schema import FINISHED

if TYPE_CHECKING:
    from .app import Durable

log = logging.getLogger("durable_celery")

# Runs per batch: each batch is one transaction holding its runs (and their key rows) locked,
# about 0.4 s at this size on a 2-core VM; bigger batches spend less per run (bench/prune.py).
BATCH = 20_000
# A rule name and the statuses it covers: "failed" stands for every unsuccessful ending.
RULES: dict[str, tuple[str, ...]] = {
    "completed": ("completed",),
    "cancelled": ("cancelled",),
    "failed": ("failed", "compensated", "compensation_failed"),
}
_UNITS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_SECONDS = re.compile(r"\d+(?:\.\d+)?")  # a bare number is seconds, in text too (``--older-than 30``)

Progress = Callable[[str], None]


def parse_duration(value: Any, what: str = "duration") -> timedelta:
    """A positive duration from a timedelta, seconds (a number, or text like ``30``), or text like
    ``30d``, ``12h``, ``1d6h``."""
    seconds: float | None = None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if _SECONDS.fullmatch(text):
            seconds = float(text)
        elif text and _PART.sub("", text) == "":
            seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
    if seconds is None:
        raise InvalidArgument(
            f"{what} must be a timedelta, a number of seconds (30) or text like '30d', '12h', '90m', "
            f"'45s' or '2w', not {value!r}"
        )
    if not seconds > 0 or seconds == float("inf"):
        raise InvalidArgument(f"{what} must be positive, not {value!r}")
    return timedelta(seconds=seconds)


def format_duration(age: timedelta) -> str:
    """A duration as short text, the way :func:`parse_duration` reads it (``1d12h``)."""
    left, parts = age.total_seconds(), []
    for unit in "dhm":
        n, left = divmod(left, _UNITS[unit])
        if n:
            parts.append(f"{int(n)}{unit}")
    if left or not parts:
        parts.append(f"{left:g}s")
    return "".join(parts)


def check_rules(rules: Any) -> dict[str, timedelta] | None:
    """The ``prune=`` setting checked and normalized: rule name -> age (None when off)."""
    if rules is None or rules == {}:
        return None
    if not isinstance(rules, Mapping):
        raise InvalidDefinition(
            f"prune must be a dict like {{'completed': timedelta(days=7)}}, not {rules!r}"
        )
    unknown = set(rules) - set(RULES)
    if unknown:
        raise InvalidDefinition(
            f"unknown prune rule(s) {', '.join(map(repr, sorted(map(str, unknown))))}; "
            f"use {', '.join(RULES)} ('failed' covers failed, compensated, compensation_failed)"
        )
    try:
        return {name: parse_duration(age, f"prune[{name!r}]") for name, age in rules.items()}
    except InvalidArgument as exc:
        raise InvalidDefinition(str(exc)) from None


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
    durable: Durable,
    statuses: tuple[str, ...],
    age: timedelta,
    label: str,
    progress: Progress | None,
    max_batches: int | None = None,
) -> tuple[int, bool]:
    """Delete in batches of BATCH until a batch comes back short (or ``max_batches`` ran); one
    activity entry per batch. Returns the runs deleted and whether more may be left."""
    db, total, batches = durable.db, 0, 0
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


def prune(durable: Durable, progress: Progress | None = None) -> dict[str, int]:
    """Run the configured ``prune=`` rules now; returns runs deleted per rule ({} when off)."""
    counts, _ = _prune(durable, progress, None)
    return counts


def prune_some(durable: Durable) -> bool:
    """One batch per ``prune=`` rule, as the workers' upkeep runs it between its other passes;
    True while more may be left (upkeep then comes back at its next pass, not in an hour)."""
    _, more = _prune(durable, None, 1)
    return more


def _prune(
    durable: Durable, progress: Progress | None, max_batches: int | None
) -> tuple[dict[str, int], bool]:
    rules = durable.settings.prune or {}
    counts, more = {}, False
    for name, age in rules.items():
        counts[name], left = _delete_batches(durable, RULES[name], age, name, progress, max_batches)
        more = more or left
    if any(counts.values()):
        log.info("durable: pruned %s", ", ".join(f"{n} {k}" for k, n in counts.items()))
    return counts, more


def cleanup(
    durable: Durable,
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
    db = durable.db
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
    deleted, _ = _delete_batches(durable, chosen, age, "cleanup", progress)
    return {**found, "runs": deleted}
