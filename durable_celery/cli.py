"""The ``celery -A app durable ...`` command group."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from .app import STATUSES, Durable
from .errors import DurableError, NotConfigured


def durable_of(ctx: click.Context) -> Durable:
    """The ``Durable`` bound to the app given with ``celery -A``."""
    app = ctx.obj.app if ctx.obj is not None else None
    durable = getattr(app, "_durable", None)
    if durable is None:
        raise click.ClickException(
            str(NotConfigured("the app given with -A has no Durable(app); create one in its module"))
        )
    return durable


@click.group(name="durable")
@click.pass_context
def durable(ctx: click.Context) -> None:
    """Durable workflows: schema, runs and their control."""


@durable.command()
@click.option("--check", is_flag=True, help="Exit 1 if the database is behind; change nothing.")
@click.pass_context
def migrate(ctx: click.Context, check: bool) -> None:
    """Bring the database schema up to date (or check that it is)."""
    d = durable_of(ctx)
    if check:
        pending = d.pending_migrations()
        if pending:
            click.echo(f"database is behind: {len(pending)} revision(s) pending: {', '.join(pending)}")
            sys.exit(1)
        click.echo("database is up to date")
        return
    d.migrate(progress=click.echo)


@durable.command()
@click.option("--workflow", "-w", help="Only runs of this workflow.")
@click.option("--key", "-k", help="Only runs started with this key.")
@click.option("--status", "-s", type=click.Choice(STATUSES), help="Only runs in this status.")
@click.option("--limit", "-n", default=50, show_default=True, help="At most this many runs.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def runs(
    ctx: click.Context, workflow: str | None, key: str | None, status: str | None, limit: int, as_json: bool
) -> None:
    """List runs, newest first."""
    found = durable_of(ctx).list_runs(workflow=workflow, key=key, status=status, limit=limit)
    if as_json:
        for run in found:
            click.echo(json.dumps(_run_dict(run), default=str))
        return
    click.echo(f"{'id':36}  {'workflow':20}  {'status':12}  {'step':>4}  {'key':24}  {'holds':5}  created")
    for run in found:
        click.echo(
            f"{run.id:36}  {run.workflow[:20]:20}  {run.status:12}  {run.step_index:>4}  "
            f"{(run.key or '-')[:24]:24}  {'yes' if run.holds_key else '-':5}  "
            f"{run.created_at:%Y-%m-%d %H:%M:%S}"
        )


@durable.command()
@click.argument("run_id")
@click.pass_context
def show(ctx: click.Context, run_id: str) -> None:
    """Show one run and its recorded steps."""
    d = durable_of(ctx)
    run = _or_fail(d.get_run, run_id)
    click.echo(json.dumps(_run_dict(run), default=str, indent=2))
    for step in d.list_steps(run_id):
        outcome = step.error["message"] if step.error else json.dumps(step.output, default=str)
        what = "compensation of " if step.phase == "compensate" else ""
        click.echo(f"  {step.step_index}. {what}{step.name} attempt {step.attempt}: {step.status} {outcome}")
    for child in d.list_children(run_id):
        click.echo(f"  child {child.id} ({child.workflow}): {child.status}")


@durable.command()
@click.argument("run_ids", nargs=-1, required=True)
@click.pass_context
def cancel(ctx: click.Context, run_ids: tuple[str, ...]) -> None:
    """Cancel unfinished runs."""
    d = durable_of(ctx)
    for run_id in run_ids:
        done = _or_fail(d.cancel, run_id)
        click.echo(f"{run_id}: {'cancelled' if done else 'already finished'}")


@durable.command()
@click.option("--workflow", "-w", help="Only keys of this workflow.")
@click.option("--limit", "-n", default=50, show_default=True, help="At most this many keys.")
@click.pass_context
def keys(ctx: click.Context, workflow: str | None, limit: int) -> None:
    """The key report: held keys, their holders, re-adds and hand-offs."""
    d = durable_of(ctx)
    stats = d.stats.keys(workflow=workflow)
    click.echo(
        f"keys held: {stats['keys_held']}   re-adds (7 days): {stats['readds']}   "
        f"dropped inputs: {stats['dropped_inputs']}   hand-offs: {stats['handoffs']}   "
        f"released: {stats['releases']}   retaken: {stats['retakes']}"
    )
    if stats["readds_by_outcome"]:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(stats["readds_by_outcome"].items()))
        click.echo(f"re-adds by outcome: {outcomes}")
    if stats["top_keys"]:
        click.echo(
            "most re-added: "
            + ", ".join(f"{t['workflow']}/{t['key']} ({t['readds']})" for t in stats["top_keys"])
        )
    click.echo("")
    click.echo(f"{'workflow':20}  {'key':32}  {'holder':36}  {'status':12}  {'runs':>4}  {'re-adds 24h':>11}")
    for entry in d.list_keys(workflow=workflow, limit=limit):
        click.echo(
            f"{entry.workflow[:20]:20}  {entry.key[:32]:32}  {entry.holder_id:36}  "
            f"{entry.holder_status:12}  {entry.runs:>4}  {entry.readds_last_day:>11}"
        )


@durable.command(name="release-key")
@click.argument("run_id")
@click.option("--by", help="Who releases it (recorded in activity).")
@click.pass_context
def release_key(ctx: click.Context, run_id: str, by: str | None) -> None:
    """Free a finished run's key so a new start can take it."""
    _or_fail(durable_of(ctx).release_key, run_id, by)
    click.echo(f"{run_id}: key released")


@durable.command()
@click.argument("run_id")
@click.pass_context
def retry(ctx: click.Context, run_id: str) -> None:
    """Resume a failed run from its failed step."""
    _or_fail(durable_of(ctx).retry, run_id)
    click.echo(f"{run_id}: retrying")


@durable.command()
@click.argument("run_id")
@click.pass_context
def rerun(ctx: click.Context, run_id: str) -> None:
    """Start a fresh copy of a finished run, with its input and key."""
    new_id = _or_fail(durable_of(ctx).rerun, run_id)
    click.echo(f"{run_id}: rerun as {new_id}")


def _or_fail(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except DurableError as exc:
        raise click.ClickException(str(exc)) from exc


def _run_dict(run: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(run)


# Commands of their own modules, registered on the group here (cli_schedules adds itself).
from . import cli_observe, cli_ops, cli_schedules  # noqa: E402, F401

for command in (
    cli_observe.status,
    cli_observe.doctor,
    cli_observe.metrics,
    cli_ops.prune,
    cli_ops.cleanup,
    cli_ops.queues_command,
    cli_ops.pause,
    cli_ops.resume,
    cli_ops.nodes,
):
    durable.add_command(command)
