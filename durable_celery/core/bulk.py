"""Bulk actions: retry, cancel, rerun or fork every run a filter names, in pages.

The runs are walked by id (keyset pages of ``BATCH``), each acted on in a transaction of its own
by the same function a single action uses (``control.retry``, ``cancel``, ``rerun``,
``forks.fork``), so no transaction holds them all and every per-run rule (the run's status, its
key, flow control) holds as it does for one run. Only runs that existed when the action began
are walked (ids grow with time: what a rerun or fork starts is never picked up). A bulk action
run again with the same filter skips what it did: a retried run is no longer failed, a
cancelled one is finished, and a rerun or fork is found by its ``origin`` entry. One ``bulk``
activity entry says who, the filter and the counts (an interrupted action's too, marked
``interrupted``); each run's own entry names the action. Each page's messages go to the broker
together (``outbox.gathering()``), not one round trip per run.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..errors import DurableError, InvalidArgument, KeyContended, KeyTaken, NotFinished, RunNotFound
from ..inputs import check_tags
from ..store import activity_rows, control_rows, queries
from ..store.run_filters import RunFilter, count_matching, matching_ids, newest_matching
from ..store.schema import FINISHED, UNFINISHED
from . import control, forks

if TYPE_CHECKING:
    from .runtime import Runtime

ACTIONS = ("retry", "cancel", "rerun", "fork")
BATCH = 500  # runs a page: one short read, then one transaction per run
STATUSES = UNFINISHED + FINISHED


@dataclass
class BulkReport:
    """What a bulk action did (or, with ``dry_run``, would do): runs matched, acted on, and
    skipped by reason."""

    action: str
    bulk_id: str
    dry_run: bool
    matched: int = 0
    acted: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)  # the runs a rerun or fork started

    def summary(self) -> str:
        """The report in one line: matched, acted on, and skipped by reason, most first."""
        verb = "would act" if self.dry_run else "acted"
        why = sorted(self.skipped.items(), key=lambda item: -item[1])
        skipped = "".join(f"; skipped {n:,}: {reason}" for reason, n in why)
        return (
            f"bulk {self.action} {self.bulk_id}: {self.matched:,} matched, {verb} on {self.acted:,}{skipped}"
        )


def run_filter(
    workflow: str | None = None,
    status: str | Sequence[str] | None = None,
    key: str | None = None,
    key_prefix: str | None = None,
    tags: Mapping[str, str] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    error_type: str | None = None,
) -> RunFilter:
    """The filter of ``list_runs`` and ``bulk``, checked: InvalidArgument for a bad value."""
    statuses = (status,) if isinstance(status, str) else tuple(status) if status is not None else None
    for value in statuses or ():
        if value not in STATUSES:
            raise InvalidArgument(f"unknown status {value!r}; one of {', '.join(STATUSES)}")
    texts = {"workflow": workflow, "key": key, "key_prefix": key_prefix, "error_type": error_type}
    for name, text in texts.items():
        if text is not None and not isinstance(text, str):
            raise InvalidArgument(f"{name} must be a str, not {text!r}")
    for name, moment in (("since", since), ("until", until)):
        if moment is not None and (not isinstance(moment, datetime) or moment.tzinfo is None):
            raise InvalidArgument(f"{name} must be a datetime with a timezone, not {moment!r}")
    try:
        checked = check_tags(tags)
    except DurableError as exc:
        raise InvalidArgument(str(exc)) from exc
    return RunFilter(workflow, statuses, key, key_prefix, checked, since, until, error_type)


def bulk(
    rt: Runtime,
    action: str,
    where: RunFilter,
    *,
    dry_run: bool = False,
    from_step: str | int | None = None,
    by: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> BulkReport:
    """Act on every run ``where`` names (see the module); the report of what was done."""
    if action not in ACTIONS:
        raise InvalidArgument(f"unknown bulk action {action!r}; one of {', '.join(ACTIONS)}")
    if (action == "fork") != (from_step is not None):
        raise InvalidArgument("from_step is for a bulk fork, and a bulk fork needs it")
    if where == RunFilter():
        raise InvalidArgument("a bulk action needs a filter: give at least one (every run is too many)")
    report = BulkReport(action, _bulk_id(action, where, from_step), dry_run)
    with rt.db.engine.connect() as conn:
        report.matched = count_matching(rt.db, conn, where, 10**9)
        last = newest_matching(rt.db, conn, where)  # the walk stops there
    skipped: Counter[str] = Counter()
    try:
        _walk(rt, report, where, last, skipped, from_step, by, progress)
    except BaseException:  # interrupted (Ctrl-C, an error): the entry says how far it went
        report.skipped = dict(skipped)
        _record(rt, report, where, from_step, by, interrupted=True)
        raise
    report.skipped = dict(skipped)
    _record(rt, report, where, from_step, by)
    return report


def _walk(
    rt: Runtime,
    report: BulkReport,
    where: RunFilter,
    last: str | None,
    skipped: Counter[str],
    from_step: Any,
    by: str | None,
    progress: Callable[[str], None] | None,
) -> None:
    """The matching runs up to ``last``, page by page, each acted on (counted into ``report``)."""
    after: str | None = None
    while last is not None:
        with rt.db.engine.connect() as conn:
            page = [i for i in matching_ids(rt.db, conn, where, after, BATCH) if i <= last]
        with rt.outbox.gathering():  # the page's messages go to the broker in one batch
            for run_id in page:
                reason = _act(rt, report, run_id, from_step, by)
                if reason is None:
                    report.acted += 1
                else:
                    skipped[reason] += 1
        if progress is not None and page:
            progress(f"{report.acted + sum(skipped.values()):,} of {report.matched:,} runs looked at")
        if len(page) < BATCH:
            return
        after = page[-1]


def _act(rt: Runtime, report: BulkReport, run_id: str, from_step: Any, by: str | None) -> str | None:
    """Act on one run (or, in a dry run, say whether it would be); None if acted, else why not."""
    origin = f"bulk {report.bulk_id}"
    with rt.db.engine.connect() as conn:
        row = queries.fetch_run(conn, run_id)
        if row is None:
            return "gone (pruned)"
        kind = {"rerun": "rerun", "fork": "forked"}.get(report.action)
        if kind is not None and control_rows.acted_before(conn, run_id, kind, origin):
            return f"{report.action} done by this bulk action before"
    refusal = _refusal(report.action, row)
    if refusal is not None or report.dry_run:
        return refusal
    try:
        if report.action == "retry":
            control.retry(rt, run_id, by=by, origin=origin)
        elif report.action == "cancel":
            if not control.cancel(rt, run_id, by=by, origin=origin):
                return "already ended"
        elif report.action == "rerun":
            report.made.append(_rerun(rt, row, by, origin))
        else:
            report.made.append(forks.fork(rt, run_id, from_step, by=by, origin=origin))
    except (KeyTaken, KeyContended) as exc:
        return f"key held by another run ({type(exc).__name__})"
    except (NotFinished, InvalidArgument, RunNotFound) as exc:
        return f"{type(exc).__name__}: changed meanwhile"
    return None


def _refusal(action: str, row: Any) -> str | None:
    """Why the run's status rules the action out, read before acting (rechecked when acting)."""
    if action == "retry" and row.status != "failed":
        return f"not failed ({row.status})"
    if action == "cancel" and row.status not in control.CANCELLABLE:
        return f"not cancellable ({row.status})"
    if action in ("rerun", "fork") and row.status not in FINISHED:
        return f"not finished ({row.status})"
    return None


def _rerun(rt: Runtime, row: Any, by: str | None, origin: str) -> str:
    """Rerun one run and leave a ``rerun`` entry on it naming the bulk action."""
    fresh = control.rerun(rt, row.id)
    with rt.db.begin() as conn:
        details = {"rerun": fresh, "by": by, "origin": origin}
        activity_rows.record_txn(rt.db, conn, "rerun", row.id, row.workflow, row.key, details)
    return fresh


def filter_words(where: RunFilter) -> dict[str, Any]:
    """The filter's set fields as JSON values (times in ISO 8601)."""
    words: dict[str, Any] = {}
    for name, value in vars(where).items():
        if value is not None:
            words[name] = value.isoformat() if isinstance(value, datetime) else value
    return words


def _bulk_id(action: str, where: RunFilter, from_step: Any) -> str:
    """The same action on the same filter has the same id: run again, it skips what it did."""
    text = json.dumps([action, repr(where), from_step], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _record(
    rt: Runtime,
    report: BulkReport,
    where: RunFilter,
    from_step: Any,
    by: str | None,
    interrupted: bool = False,
) -> None:
    """One ``bulk`` activity entry: who, the filter, and the counts (``interrupted``: so far)."""
    details = {
        "action": report.action,
        "bulk": report.bulk_id,
        "dry_run": report.dry_run,
        "by": by,
        "filter": filter_words(where),
        "from_step": from_step,
        "matched": report.matched,
        "acted": report.acted,
        "skipped": report.skipped,
        **({"interrupted": True} if interrupted else {}),
    }
    with rt.db.begin() as conn:
        activity_rows.record_txn(rt.db, conn, "bulk", None, where.workflow, None, details)
