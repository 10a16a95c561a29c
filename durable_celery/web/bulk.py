"""The dashboard's runs in bulk: the runs page's extra filters (a tag, a time window, an error
type, a key prefix), read from the URL, and its "all matching" action with a dry-run preview."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from ..core.bulk import bulk, run_filter
from ..errors import InvalidArgument
from ..store.run_filters import RunFilter

if TYPE_CHECKING:
    from ..app import Durable

FILTER_FIELDS = ("workflow", "status", "key", "key_prefix", "tag", "since", "until", "error_type")
BULK_ACTIONS = ("retry", "cancel", "rerun")  # fork needs a step: the CLI and the API have it


def filter_of(params: dict[str, Any]) -> RunFilter:
    """The runs the page's parameters name (InvalidArgument for a value it cannot use)."""
    tag = str(params.get("tag") or "")
    name, sep, value = tag.partition("=")
    return run_filter(
        workflow=params.get("workflow") or None,
        status=params.get("status") or None,
        key=params.get("key") or None,
        key_prefix=params.get("key_prefix") or None,
        tags={name: value} if tag and sep else ({tag: ""} if tag else None),
        since=_moment(params.get("since")),
        until=_moment(params.get("until")),
        error_type=params.get("error_type") or None,
    )


def _moment(text: Any) -> datetime | None:
    """An ISO 8601 time from a form (UTC unless it says otherwise)."""
    if not text:
        return None
    try:
        found = datetime.fromisoformat(str(text))
    except ValueError:
        raise InvalidArgument(f"{text!r} is not an ISO 8601 time (2026-12-01T14:02)") from None
    return found if found.tzinfo is not None else found.replace(tzinfo=timezone.utc)


def bulk_action(durable: Durable, form: dict[str, Any], by: str, origin: str) -> tuple[str, str]:
    """The form's action on every run its filters name, or (``dry_run``) what it would do: back
    to the runs page with those filters, and a note of the counts."""
    action = str(form.get("bulk_action") or "")
    if action not in BULK_ACTIONS:
        raise InvalidArgument(f"unknown bulk action {action!r}; one of {', '.join(BULK_ACTIONS)}")
    where = filter_of(form)
    dry = str(form.get("dry_run", "")).lower() in ("1", "true", "on", "yes")
    report = bulk(durable.runtime, action, where, dry_run=dry, by=f"{by} from {origin}")
    shown = {k: form[k] for k in FILTER_FIELDS if form.get(k)}
    skipped = "; ".join(
        f"skipped {n:,}: {why}" for why, n in sorted(report.skipped.items(), key=lambda i: -i[1])
    )
    verb = "would" if dry else "did"
    note = f"bulk {action}: {report.matched:,} matched, {verb} act on {report.acted:,}"
    return f"/runs?{urlencode(shown)}", note + (f" ({skipped})" if skipped else "")
