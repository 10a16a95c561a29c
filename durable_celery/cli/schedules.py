"""``celery -A app durable schedules``: keyed schedules with their next fire and last outcome."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime

import click

from ..schedules import problems
from ..store.db import utcnow
from .common import durable_of


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def schedules(ctx: click.Context, as_json: bool) -> None:
    """Keyed schedules: key, next fire, last outcome and failures in a row."""
    found = durable_of(ctx).list_schedules()
    if as_json:
        for entry in found:
            click.echo(json.dumps(asdict(entry), default=str))
        return
    if not found:
        click.echo("no schedules")
        return
    click.echo(
        f"{'name':24}  {'workflow':16}  {'key':20}  {'schedule':14}  {'source':8}  {'next fire':20}  "
        f"{'last outcome':14}  failures"
    )
    for entry in found:
        outcome, next_fire = entry.last_outcome or "-", _next_fire(entry.enabled, entry.next_fire_at)
        if entry.late:  # overdue by more than its period: nothing fires it
            next_fire = f"late {entry.overdue_seconds:.0f}s"
        click.echo(
            f"{entry.name[:24]:24}  {entry.workflow[:16]:16}  {(entry.key or '-')[:20]:20}  "
            f"{entry.schedule[:14]:14}  {entry.source:8}  {next_fire:20}  "
            f"{outcome[:14]:14}  {entry.failures}"
        )
    for problem in problems(durable_of(ctx).runtime):
        click.echo(f"! {problem}")


def _next_fire(enabled: bool, at: datetime | None) -> str:
    if not enabled:
        return "disabled"
    if at is None:
        return "-"
    seconds = max(0, int((at - utcnow()).total_seconds()))
    return f"{at:%Y-%m-%d %H:%M:%S}" if seconds >= 3600 else f"in {seconds}s"
