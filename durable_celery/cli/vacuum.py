"""``celery -A app durable tune-vacuum [--apply]``: autovacuum settings for the busiest tables."""

from __future__ import annotations

from typing import Any

import click

from ..errors import DurableError
from .common import durable_of


def _durable(ctx: click.Context) -> Any:
    return durable_of(ctx)


@click.command(name="tune-vacuum")
@click.option(
    "--apply",
    "apply_them",
    is_flag=True,
    help="Run the statements (each in its own transaction, waiting at most 5 s for the table's "
    "lock) instead of printing them.",
)
@click.pass_context
def tune_vacuum(ctx: click.Context, apply_them: bool) -> None:
    """Print, or with --apply set, autovacuum settings for durable_runs and durable_steps.

    PostgreSQL vacuums a table once 20% of its rows are dead and analyzes it at 10%. A run's
    row is rewritten at every claim, record and heartbeat, so on a table of a million runs that
    is 200,000 dead rows before vacuum comes. The settings printed make it vacuum at 2% and
    analyze at 1%, with five times the default cost budget (1000) so those vacuums end
    quickly. Without --apply nothing changes: the output is SQL you can read, keep in a
    migration of your own, or pipe into psql. Undo with ALTER TABLE ... RESET (the same
    parameter names). PostgreSQL only.
    """
    from ..observe.pg_health import RECOMMENDED, apply_vacuum_statement, vacuum_statements

    d = _durable(ctx)
    if not d.db.is_postgres:
        click.echo("tune-vacuum applies to PostgreSQL only; the SQLite database needs no autovacuum settings")
        return
    try:
        planned = vacuum_statements(d.db)
    except DurableError as exc:
        raise click.ClickException(str(exc)) from exc
    if not apply_them:
        click.echo(f"-- database: {d.db.masked_url}")
        for table, options, statement in planned:
            click.echo(f"-- {table} now: {', '.join(options) or 'the server defaults'}")
            click.echo(f"{statement};")
        click.echo("-- nothing changed: run with --apply to set these")
        return
    for table, _before, statement in planned:
        click.echo(f"{table}: {statement}")
        try:
            after = apply_vacuum_statement(d.db, table, statement)
        except DurableError as exc:
            raise click.ClickException(f"{table}: {exc}") from exc
        click.echo(f"{table}: done, now {', '.join(after)}")
    click.echo(f"set {', '.join(RECOMMENDED)} on {len(planned)} table(s)")
