"""``celery -A app durable bulk``: retry, cancel, rerun or fork every run a filter names."""

from __future__ import annotations

from datetime import datetime, time, timezone
from typing import Any

import click

from ..core.bulk import ACTIONS
from .common import durable_of, or_fail


def _moment(text: str | None, day_of: datetime | None = None) -> datetime | None:
    """An ISO 8601 time (UTC unless it says otherwise); a time of day alone is on ``day_of``'s day."""
    if text is None:
        return None
    try:
        if "T" not in text and "-" not in text and day_of is not None:
            at = time.fromisoformat(text)
            return datetime.combine(day_of.date(), at, at.tzinfo or day_of.tzinfo)
        found = datetime.fromisoformat(text)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 time (2026-12-01T14:02, or 14:17)") from exc
    return found if found.tzinfo is not None else found.replace(tzinfo=timezone.utc)


def _tags(given: tuple[str, ...]) -> dict[str, str] | None:
    """``name=value`` pairs as a dict."""
    tags: dict[str, str] = {}
    for pair in given:
        name, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"{pair!r}: a tag is name=value")
        tags[name] = value
    return tags or None


@click.command()
@click.argument("action", type=click.Choice(ACTIONS))
@click.option("-w", "--workflow", help="Runs of this workflow.")
@click.option("-s", "--status", "statuses", multiple=True, help="Runs in this status (repeat for several).")
@click.option("-k", "--key", help="Runs started with this key.")
@click.option("--key-prefix", help="Runs whose key starts with this.")
@click.option("-t", "--tag", "tags", multiple=True, help="Runs tagged name=value (repeat: every one).")
@click.option("--since", help="Runs created at or after this ISO 8601 time (UTC unless it says otherwise).")
@click.option("--until", help="Runs created before this time; a time of day alone is on --since's day.")
@click.option("--error-type", help="Runs whose error is of this type (ConnectionError, say).")
@click.option("--from-step", help="fork: the step (name or index) the forks begin at.")
@click.option("--dry-run", is_flag=True, help="Count what would be done; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask before acting.")
@click.option("--by", default="cli", show_default=True, help="Who acts (recorded in activity).")
@click.pass_context
def bulk(ctx: click.Context, action: str, **options: Any) -> None:
    """Retry, cancel, rerun or fork every run the filters name, in pages, showing progress."""
    d = durable_of(ctx)
    since = _moment(options["since"])
    filters = {
        "workflow": options["workflow"],
        "status": list(options["statuses"]) or None,
        "key": options["key"],
        "key_prefix": options["key_prefix"],
        "tags": _tags(options["tags"]),
        "since": since,
        "until": _moment(options["until"], since),
        "error_type": options["error_type"],
    }
    step = options["from_step"]
    from_step = int(step) if step is not None and step.isdigit() else step
    preview = or_fail(lambda: d.bulk(action, dry_run=True, from_step=from_step, by=options["by"], **filters))
    _say(preview)
    if options["dry_run"] or not preview.acted:
        return
    if not options["yes"]:
        click.confirm(f"{action} {preview.acted:,} run(s)?", abort=True)
    report = or_fail(
        lambda: d.bulk(action, from_step=from_step, by=options["by"], progress=click.echo, **filters)
    )
    _say(report)


def _say(report: Any) -> None:
    """The report in a few lines."""
    verb = "would" if report.dry_run else "did"
    click.echo(
        f"bulk {report.action} ({report.bulk_id}): {report.matched:,} matched, {verb} act on {report.acted:,}"
    )
    for reason, count in sorted(report.skipped.items(), key=lambda item: -item[1]):
        click.echo(f"  skipped {count:,}: {reason}")
