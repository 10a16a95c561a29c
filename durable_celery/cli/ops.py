"""``celery -A app durable`` commands for operations: prune, cleanup, queues, pause, resume, nodes."""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING, Any

import click

from ..settings import RULES, format_duration
from ..store.schema import FINISHED
from .common import durable_of, or_fail

if TYPE_CHECKING:
    pass


@click.command()
@click.pass_context
def prune(ctx: click.Context) -> None:
    """Delete finished runs past the ages set with Durable(prune=...), now."""
    d = durable_of(ctx)
    if not d.settings.prune:
        click.echo("pruning is off: set Durable(app, prune={'completed': timedelta(days=7), ...})")
        return
    for name, age in d.settings.prune.items():
        click.echo(f"rule {name} ({', '.join(RULES[name])}): finished over {format_duration(age)} ago")
    counts = or_fail(d.prune, click.echo)
    click.echo("pruned: " + ", ".join(f"{n} {name}" for name, n in counts.items()))


@click.command()
@click.option(
    "--older-than",
    required=True,
    help="Age of finished runs to delete: 30d, 12h, 90m, 45s, 2w, or a number of seconds (30).",
)
@click.option(
    "--status",
    "-s",
    "statuses",
    multiple=True,
    help=f"Only runs in this finished status (repeatable; default all: {', '.join(FINISHED)}).",
)
@click.option("--dry-run", is_flag=True, help="Only count what would be deleted; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="The counts as one JSON object (progress on stderr).")
@click.pass_context
def cleanup(
    ctx: click.Context, older_than: str, statuses: tuple[str, ...], dry_run: bool, as_json: bool
) -> None:
    """Delete finished runs older than --older-than, with their steps, events and keys."""
    d = durable_of(ctx)
    progress = partial(click.echo, err=True) if as_json else click.echo
    found = or_fail(lambda: d.cleanup(older_than, statuses or None, dry_run=dry_run, progress=progress))
    if as_json:
        click.echo(json.dumps({**found, "dry_run": dry_run}))
    elif dry_run:
        click.echo("dry run: nothing was deleted")
    else:
        click.echo(f"done: deleted {found['runs']} run(s)")


@click.command(name="queues")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per queue, one a line.")
@click.pass_context
def queues_command(ctx: click.Context, as_json: bool) -> None:
    """Per queue: ready, running and waiting runs, the oldest ready run, paused or not."""
    stats = durable_of(ctx).reader.stats.queues()
    if as_json:
        for name, entry in stats.items():
            click.echo(json.dumps({"queue": name, **entry}, default=str))
        return
    click.echo(f"{'queue':30}  {'ready':>7}  {'running':>7}  {'waiting':>7}  {'paused':6}  oldest ready")
    for name, entry in stats.items():
        oldest = entry["oldest_ready_at"]
        click.echo(
            f"{name[:30]:30}  {entry['ready']:>7}  {entry['running']:>7}  {entry['waiting']:>7}  "
            f"{'yes' if entry['paused'] else '-':6}  {f'{oldest:%Y-%m-%d %H:%M:%S}' if oldest else '-'}"
        )


@click.command()
@click.argument("name")
@click.pass_context
def pause(ctx: click.Context, name: str) -> None:
    """Pause queue NAME on every worker until it is resumed."""
    or_fail(durable_of(ctx).pause_queue, name)
    click.echo(f"queue {name}: paused")


@click.command()
@click.argument("name")
@click.pass_context
def resume(ctx: click.Context, name: str) -> None:
    """Resume queue NAME on every worker."""
    ready = or_fail(durable_of(ctx).resume_queue, name)
    click.echo(f"queue {name}: resumed, {ready} ready run(s) sent again")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per node, one a line.")
@click.pass_context
def nodes(ctx: click.Context, as_json: bool) -> None:
    """Worker nodes seen in the last day: queues, pid, draining, started, last seen."""
    found: list[dict[str, Any]] = durable_of(ctx).reader.list_nodes()
    if as_json:
        for node in found:
            click.echo(json.dumps(node, default=str))
        return
    click.echo(f"{'node':40}  {'pid':>7}  {'draining':8}  {'started':19}  {'seen':19}  queues")
    for node in found:
        click.echo(
            f"{node['name'][:40]:40}  {node['pid'] or '-':>7}  {'yes' if node['draining'] else '-':8}  "
            f"{node['started_at']:%Y-%m-%d %H:%M:%S}  {node['seen_at']:%Y-%m-%d %H:%M:%S}  "
            f"{', '.join(node['queues'])}"
        )
