"""``celery -A app durable status | doctor | metrics``: watching a deployment from the shell."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from ..errors import DurableError
from ..observe.pg_health import table_lines
from ..worker.app_argument import app_argument
from .common import durable_of


def _durable(ctx: click.Context) -> Any:
    return durable_of(ctx)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Summary: schema, runs per status, ready backlog and oldest ready run, locks, nodes."""
    d = _durable(ctx).reader
    pending = d.pending_migrations()
    if pending:
        migrate = f"celery -A {app_argument()} durable migrate"
        click.echo(f"schema: {len(pending)} revision(s) behind at {d.db.masked_url}; run `{migrate}`")
        sys.exit(1)
    info = d.status_summary()
    info["late_schedules"] = _late_schedules(d)
    if as_json:
        click.echo(json.dumps(info, default=str))
        return
    click.echo(f"database: {d.db.masked_url}")
    click.echo("schema: up to date")
    cap = info["runs_counted_to"]
    runs = "  ".join(f"{s} {n:,}{'+' if n >= cap else ''}" for s, n in sorted(info["runs"].items())) or "none"
    click.echo(f"runs: {runs}")
    oldest = info["oldest_ready_seconds"]
    click.echo(
        f"ready: {info['ready']}   oldest ready: {'-' if oldest is None else _age(oldest)}   "
        f"stale locks: {info['stale_locks']}   disabled schedules: {len(info['disabled_schedules'])}"
    )
    for queue, ready in sorted(info["no_consumer"].items()):
        click.echo(
            f"no consumer: queue {queue} has {ready} ready run(s) and no live worker consumes it "
            f"(start a worker with -Q {queue})"
        )
    for late in info["late_schedules"]:
        click.echo(
            f"late schedule: {late['name']} ({late['schedule']}) should have fired "
            f"{_age(late['overdue_seconds'])} ago; is `{late['beat']}` running?"
        )
    if info["unfinished_by_workflow"]:
        click.echo("")
        click.echo(f"{'workflow':30}  {'status':14}  {'runs':>6}  {'ready':>6}")
        for row in sorted(info["unfinished_by_workflow"], key=lambda r: (r["workflow"], r["status"])):
            ready = info["ready_by_workflow"].get(row["workflow"], 0) if row["status"] != "running" else ""
            click.echo(f"{row['workflow'][:30]:30}  {row['status']:14}  {row['runs']:>6}  {ready:>6}")
    click.echo("")
    if not info["nodes"]:
        click.echo("nodes: none seen")
    for node in info["nodes"]:
        state = "draining" if node["draining"] else "up"
        queues = ",".join(node["queues"] or [])
        click.echo(
            f"node {node['name']}  {state}  queues {queues}  seen {_age(node['seen_seconds_ago'])} ago"
        )
    click.echo("")
    for line in table_lines(info["tables"], d.db.is_postgres):
        click.echo(line)


def _late_schedules(d: Any) -> list[dict[str, Any]]:
    """Schedules overdue by more than their period plus a margin (beat is not firing them)."""
    from redis.exceptions import RedisError

    from ..schedules import beat_command

    try:
        found = d.list_schedules()
    except RedisError as exc:  # RedBeat's Redis unreachable: the rest of the status still counts
        click.echo(f"schedules: could not be read ({exc})", err=True)
        return []
    beat = beat_command(d.app)
    return [
        {"name": s.name, "schedule": s.schedule, "overdue_seconds": s.overdue_seconds, "beat": beat}
        for s in found
        if s.late
    ]


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


@click.command()
@click.option(
    "--fix",
    is_flag=True,
    help="Repair what is safe: stale locks, missed wake-ups, orphaned children, unsent runs.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per finding.")
@click.pass_context
def doctor(ctx: click.Context, fix: bool, as_json: bool) -> None:
    """Report stuck state; exit 1 when something is found (without --fix) or could not be fixed."""
    try:
        findings = (_durable(ctx) if fix else _durable(ctx).reader).doctor(fix=fix)
    except DurableError as exc:
        raise click.ClickException(str(exc)) from exc
    for finding in findings:
        if as_json:
            click.echo(json.dumps(finding.as_dict(), default=str))
            continue
        what = finding.run_id or finding.details.get("schedule") or "-"
        mark = (
            " [fixed]" if finding.fixed else (" [fixable with --fix]" if finding.fixable and not fix else "")
        )
        click.echo(f"{finding.kind:22}  {what:36}  {finding.workflow or '-':20}  {finding.message}{mark}")
    if not as_json:
        fixed = sum(f.fixed for f in findings)
        click.echo(f"{len(findings)} finding(s)" + (f", {fixed} fixed" if fix else ""))
    unfixed = [f for f in findings if f.fixable and not f.fixed] if fix else findings
    if unfixed:
        sys.exit(1)


@click.command()
@click.option("--port", default=9808, show_default=True, help="Port of the /metrics endpoint.")
@click.option(
    "--addr",
    default=None,
    help="Address to listen on; 0.0.0.0 opens it to every interface.  "
    "[default: the metrics_addr setting, 127.0.0.1]",
)
@click.pass_context
def metrics(ctx: click.Context, port: int, addr: str | None) -> None:
    """Serve the database gauges on http://ADDR:PORT/metrics until stopped (Ctrl+C)."""
    from ..observe.metrics import metrics_url

    d = _durable(ctx)
    addr = d.settings.metrics_addr if addr is None else addr
    try:
        server = d.metrics.start_http_server(port, addr)
    except DurableError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"serving durable metrics on {metrics_url(addr, server.server_port)}", err=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
