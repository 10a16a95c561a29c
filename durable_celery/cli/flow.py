"""``celery -A app durable flow [--workflow NAME] [--json]``: each flow limit's use per key."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime
from typing import Any

import click

from .common import or_fail, reader_of


@click.command(name="flow")
@click.option(
    "--workflow", "-w", metavar="NAME", help="Only this workflow (defined in the app given with -A)."
)
@click.option("--limit", "-n", default=50, show_default=True, help="At most this many keys per limit.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per workflow and key, one a line.")
@click.pass_context
def flow(ctx: click.Context, workflow: str | None, limit: int, as_json: bool) -> None:
    """Flow control: per workflow with concurrency, throttle, rate_limit or batch, its limits
    and per key their use, keys with most runs waiting first; open batches.

    concurrency: slots in use of the limit, and runs parked for a slot (served in line: start
    order, higher priorities first, round the fair keys). throttle: runs begun (a worker
    claimed their first step) in the current period, runs
    parked until the window lets them begin, and when the soonest looks again ("again at").
    rate_limit: starts in the current period (a start past the limit raises RateLimited; "again
    at": when one is accepted again). Under a key with runs parked, "held:" says why they wait,
    in the words of the first one's run page. Under a fair limit, each fair key's weight, slots
    in use (and share of them) and runs waiting; runs held per priority when any has one. batch:
    each open batch's key, its items of max, when it closes and its run. Only
    workflows defined in the app given with -A are shown.
    """
    from ..observe.flow import flow_report

    d = reader_of(ctx)
    found = or_fail(flow_report, d.runtime, workflow, limit)
    if as_json:
        for entry in found:
            _echo_json(entry)
        return
    if not found:
        click.echo("no workflow defined here has a concurrency, throttle, rate_limit or batch option")
        return
    for number, entry in enumerate(found):
        if number:
            click.echo("")
        _echo_workflow(entry)


def _echo_json(entry: Any) -> None:
    """One workflow of ``durable flow --json``: a JSON object per key, fair key, priority and batch."""
    if not entry.keys:
        click.echo(json.dumps({"workflow": entry.workflow, "limits": entry.limits}))
    for key in entry.keys:
        line = {"workflow": entry.workflow, "limits": entry.limits, **asdict(key)}
        click.echo(json.dumps(line, default=_jsonable))
    for share in entry.fair:
        line = {"workflow": entry.workflow, "kind": "fair", **asdict(share)}
        click.echo(json.dumps(line, default=_jsonable))
    if set(entry.priorities) - {0}:
        line = {"workflow": entry.workflow, "kind": "priorities", "held": entry.priorities}
        click.echo(json.dumps(line))
    for batch in entry.batches:
        line = {"workflow": entry.workflow, "kind": "batch", **asdict(batch)}
        click.echo(json.dumps(line, default=_jsonable))


def _echo_workflow(entry: Any) -> None:
    from ..observe.flow import key_words, limit_words, use_words

    limits = "; ".join(f"{kind} {limit_words(kind, shown)}" for kind, shown in entry.limits.items())
    click.echo(f"{entry.workflow}: {limits}")
    _echo_batches(entry)
    if not entry.keys:
        if set(entry.limits) - {"batch"}:
            click.echo("  nothing in use")
        return
    click.echo(
        f"  {'limit':11}  {'key':32}  {'use':28}  {'waiting':>7}  {'again at':23}  "
        f"{'oldest waiting start':23}"
    )
    for key in entry.keys:
        waiting = "-" if key.kind == "rate_limit" else str(key.waiting)
        click.echo(
            f"  {key.kind:11}  {key_words(key.key)[:32]:32}  {use_words(key)[:28]:28}  {waiting:>7}  "
            f"{_when(key.next_look or key.until):23}  {_when(key.oldest_waiting):23}"
        )
        if key.held:
            click.echo(f"    held: {key.held}")
    for share in entry.fair:
        click.echo(
            f"  fair {share.key[:32]:32}  weight {share.weight:g}  {share.in_use} in use "
            f"({share.share:.0%})  {share.waiting} waiting  "
            f"oldest waiting start {_when(share.oldest_waiting)}"
        )
    if set(entry.priorities) - {0}:
        held = ", ".join(f"{p}: {n}" for p, n in sorted(entry.priorities.items(), reverse=True))
        click.echo(f"  held by priority: {held}")


def _echo_batches(entry: Any) -> None:
    from ..observe.flow import key_words

    if entry.limits.get("batch") is not None and not entry.batches:
        click.echo("  no batch open")
    for batch in entry.batches:
        click.echo(
            f"  batch {key_words(batch.key)[:32]:32}  {batch.items} of {batch.max} items  "
            f"closes at {_when(batch.closes_at)}  run {batch.run_id}"
        )


def _when(at: datetime | None) -> str:
    return "-" if at is None else at.strftime("%Y-%m-%d %H:%M:%S UTC")


def _jsonable(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else str(value)
