"""The ``celery -A app durable ...`` command group."""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import asdict
from typing import Any

import click
import psycopg
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from ..app import STATUSES, Durable
from ..errors import DatabaseUnavailable, DurableError, NotConfigured, SchemaOutdated
from ..worker.app_argument import app_argument
from . import bulk as cli_bulk
from . import flow as cli_flow
from . import observe as cli_observe
from . import ops as cli_ops
from . import schedules as cli_schedules
from . import vacuum as cli_vacuum
from . import web as cli_web
from .common import durable_of, or_fail, reader_of
from .key_report import blocks_new_starts

STATUS_WIDTH = max(len(s) for s in STATUSES)  # compensation_failed, the longest

# What a command's error may come from to be told as ``durable: ...``: an error of the package
# (a database that cannot be used included), however the command met it.
UNUSABLE = (DurableError, SQLAlchemyError)
EXPLAINED = (DatabaseUnavailable, NotConfigured, SchemaOutdated, SQLAlchemyError)


class ErrorBoundary(click.Group):
    """A group whose commands turn a database that cannot be used (down, wrong URL, unmigrated)
    and every DurableError, raised or wrapped in a ClickException, into
    ``durable: <what happened>`` and a hint on stderr, exit 1 (click's usage errors stay its own);
    ``--traceback`` shows the whole traceback instead."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            cause = exc.__cause__
            if not isinstance(cause, UNUSABLE):
                raise
            # The command's own words for an error of the package; explained ones get their fix.
            self._fail(ctx, exc, cause if isinstance(cause, EXPLAINED) else exc)
        except (DurableError, SQLAlchemyError, psycopg.Error) as exc:
            self._fail(ctx, exc, exc)

    def _fail(self, ctx: click.Context, exc: BaseException, cause: BaseException) -> None:
        if ctx.meta.get("durable.traceback"):
            click.echo("".join(traceback.format_exception(exc)).rstrip(), err=True)
        else:
            what, *fix = (
                [cause.format_message()]
                if isinstance(cause, click.ClickException)
                else explain(cause, _masked_url(ctx))
            )
            click.echo(f"durable: {what}", err=True)
            for line in fix:
                click.echo(line, err=True)
        ctx.exit(1)

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        """Register ``cmd`` and accept ``--traceback`` after its name too."""
        if not any(param.name == "traceback" for param in cmd.params):
            cmd.params.append(_traceback_option())
        super().add_command(cmd, name)


TRACEBACK_HELP = "On an error, show the whole traceback instead of one line and a fix."


def _want_traceback(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta["durable.traceback"] = True


def _traceback_option() -> click.Option:
    return click.Option(
        ["--traceback"],
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_want_traceback,
        help=TRACEBACK_HELP,
    )


def _masked_url(ctx: click.Context) -> str:
    app = ctx.obj.app if ctx.obj is not None else None
    db = getattr(getattr(app, "_durable", None), "db", None)
    return getattr(db, "masked_url", None) or "the database"


def explain(error: BaseException, url: str) -> list[str]:
    """What happened (one line) and, when there is one, what to do (a line starting "fix:")."""
    if isinstance(error, DatabaseUnavailable):
        return [f"database unavailable at {error.url} ({error.reason})", f"fix: {error.fix}"]
    if isinstance(error, NotConfigured):
        return [str(error)]
    if isinstance(error, SchemaOutdated):
        default = f"run `celery -A {app_argument()} durable migrate`"
        return [
            f"the database at {error.url} has no durable schema, or an old one ({error.reason})",
            f"fix: {error.fix if error.fix != error.FIX else default}",
        ]
    reason = _first_line(error)
    if isinstance(error, DurableError):
        return [reason]
    if isinstance(error, ArgumentError):  # a URL SQLAlchemy cannot use (parsed after the import)
        return [f"cannot use the database URL {url} ({reason})", "fix: use postgresql://... or sqlite:///..."]
    return [f"database error at {url}: {reason}", "fix: --traceback (before or after the command) for more"]


def _first_line(error: BaseException) -> str:
    original = getattr(error, "orig", None) or error
    lines = str(original).strip().splitlines()
    return (lines[0].strip() if lines else type(original).__name__)[:200]


@click.group(name="durable", cls=ErrorBoundary)
@click.option(
    "--traceback",
    is_flag=True,
    expose_value=False,
    callback=_want_traceback,
    help=TRACEBACK_HELP,
)
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
@click.option("--after", metavar="RUN_ID", help="The next page: runs older than this one (the last listed).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def runs(
    ctx: click.Context,
    workflow: str | None,
    key: str | None,
    status: str | None,
    limit: int,
    after: str | None,
    as_json: bool,
) -> None:
    """List runs, newest first; "holds" is yes for a run whose key blocks a new start, free for a
    finished holder whose key the next start takes."""
    d = reader_of(ctx)  # a report: the replica when there is one
    found = or_fail(lambda: d.list_runs(workflow=workflow, key=key, status=status, limit=limit, after=after))
    if as_json:
        for run in found:
            click.echo(json.dumps({**_run_dict(run), "key_blocks": _key_blocks(d, run)}, default=str))
        if len(found) == limit:  # on standard error: standard output stays one object a line
            click.echo(f"next page: --after {found[-1].id}", err=True)
        return
    click.echo(
        f"{'id':36}  {'workflow':20}  {'status':{STATUS_WIDTH}}  {'step':>4}  "
        f"{'key':24}  {'holds':5}  created"
    )
    for run in found:
        click.echo(
            f"{run.id:36}  {run.workflow[:20]:20}  {run.status:{STATUS_WIDTH}}  {run.step_index:>4}  "
            f"{(run.key or '-')[:24]:24}  {_holds(d, run):5}  "
            f"{run.created_at:%Y-%m-%d %H:%M:%S}"
        )
    if len(found) == limit:
        click.echo(f"next page: --after {found[-1].id}")


@durable.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: the run, its steps and children.")
@click.pass_context
def show(ctx: click.Context, run_id: str, as_json: bool) -> None:
    """Show one run, its recorded step attempts and its children."""
    d = reader_of(ctx)  # a report: the replica when there is one
    run = or_fail(d.get_run, run_id)
    steps, children = d.list_steps(run_id), d.list_children(run_id)
    if as_json:
        whole = {
            **_run_dict(run),
            "key_blocks": _key_blocks(d, run),
            "steps": [asdict(step) for step in steps],
            "children": [_run_dict(child) for child in children],
        }
        click.echo(json.dumps(whole, default=str))
        return
    for label, value in _run_fields(d, run):
        click.echo(f"{label:10}  {value}")
    click.echo(f"steps ({len(steps)})" if steps else "steps: none recorded")
    for step in steps:
        outcome = step.error["message"] if step.error else json.dumps(step.output, default=str)
        what = "compensation of " if step.phase == "compensate" else ""
        click.echo(f"  {step.step_index}. {what}{step.name} attempt {step.attempt}: {step.status} {outcome}")
    if children:
        click.echo(f"children ({len(children)})")
    for child in children:
        click.echo(f"  child {child.id} ({child.workflow}): {child.status}")


@durable.command()
@click.argument("run_ids", nargs=-1, required=True)
@click.pass_context
def cancel(ctx: click.Context, run_ids: tuple[str, ...]) -> None:
    """Cancel unfinished runs."""
    d = durable_of(ctx)
    for run_id in run_ids:
        done = or_fail(d.cancel, run_id)
        click.echo(f"{run_id}: {'cancelled' if done else 'already finished'}")


@durable.command()
@click.option("--workflow", "-w", help="Only keys of this workflow.")
@click.option("--key", "-k", "prefix", metavar="PREFIX", help="Only keys starting with PREFIX.")
@click.option("--limit", "-n", default=50, show_default=True, help="At most this many keys.")
@click.option("--after", metavar="CURSOR", help="The next page: the cursor a full page ends with.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per key, one a line.")
@click.option(
    "--html",
    "html_file",
    type=click.File("w", encoding="utf-8", lazy=True),
    metavar="FILE",
    help="Write the key report to FILE as one static HTML page ('-': standard output).",
)
@click.pass_context
def keys(
    ctx: click.Context,
    workflow: str | None,
    prefix: str | None,
    limit: int,
    after: str | None,
    as_json: bool,
    html_file: Any,
) -> None:
    """The key report: keys, their holders, whether each blocks a new start, re-adds and hand-offs."""
    if as_json and html_file is not None:
        raise click.UsageError("give --json or --html, not both")
    d = reader_of(ctx)  # a report: the replica when there is one
    found = or_fail(lambda: d.list_keys(workflow, limit, prefix=prefix, after=after))
    scope = _key_scope(workflow, prefix, limit, len(found))
    if as_json:
        for entry in found:
            click.echo(json.dumps(asdict(entry), default=str))
        _echo_next_keys(found, limit, err=True)  # standard output stays one object a line
        return
    if html_file is not None:
        from ..store.db import utcnow
        from .key_report import render_key_report

        html_file.write(render_key_report(found, generated_at=utcnow(), scope=scope))
        if html_file.name != "-":
            click.echo(f"key report ({len(found)} keys) written to {html_file.name}")
        _echo_next_keys(found, limit, err=True)
        return
    if prefix:  # the counts are the workflow's (or every workflow's), not only the listed keys'
        click.echo(f"{f'workflow {workflow}' if workflow else 'every workflow'}, every key:")
    _echo_key_stats(d.stats.keys(workflow=workflow))
    click.echo("")
    click.echo(
        f"{'workflow':20}  {'key':32}  {'holder':36}  {'status':12}  {'blocks':6}  {'waiting':36}  "
        f"{'runs':>4}  {'re-adds 24h':>11}"
    )
    for entry in found:
        click.echo(
            f"{entry.workflow[:20]:20}  {entry.key[:32]:32}  {entry.holder_id:36}  "
            f"{entry.holder_status:12}  {'yes' if entry.blocks else 'free':6}  {entry.waiting_id or '-':36}  "
            f"{entry.runs:>4}  {entry.readds_last_day:>11}"
        )
    blocking = sum(1 for e in found if e.blocks)
    click.echo(
        f"{len(found)} {'key' if len(found) == 1 else 'keys'}, {blocks_new_starts(blocking)} ({scope})"
    )
    _echo_next_keys(found, limit)


def _echo_next_keys(found: list[Any], limit: int, err: bool = False) -> None:
    """A full page ends with the option that lists the next one."""
    if len(found) == limit and found[-1].cursor is not None:
        click.echo(f"next page: --after {found[-1].cursor}", err=err)


def _echo_key_stats(stats: dict[str, Any]) -> None:
    held, blocking, cap = stats["keys_held"], stats["blocking"], stats.get("count_cap", 0)

    def n(value: int) -> str:  # a count that stopped at the cap reads "10,000+"
        return f"{value:,}+" if cap and value >= cap else str(value)

    free = "some" if cap and held >= cap else str(held - blocking)
    verb = "blocks" if blocking == 1 else "block"
    click.echo(
        f"keys held: {n(held)} ({n(blocking)} {verb} new starts, {free} free to take)   "
        f"re-adds (7 days): {n(stats['readds'])}   dropped inputs: {stats['dropped_inputs']}   "
        f"hand-offs: {n(stats['handoffs'])}   released: {n(stats['releases'])}   "
        f"retaken: {n(stats['retakes'])}"
    )
    of = stats.get("breakdown_of", 0)
    newest = f" (of the newest {of:,})" if of < stats["readds"] else ""
    if stats["readds_by_outcome"]:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(stats["readds_by_outcome"].items()))
        click.echo(f"re-adds by outcome{newest}: {outcomes}")
    if stats["top_keys"]:
        click.echo(
            f"most re-added{newest}: "
            + ", ".join(f"{t['workflow']}/{t['key']} ({t['readds']})" for t in stats["top_keys"])
        )


def _key_scope(workflow: str | None, prefix: str | None, limit: int, listed: int) -> str:
    parts = [f"workflow {workflow}" if workflow else "every workflow"]
    if prefix:
        parts.append(f"keys starting with {prefix!r}")
    if listed >= limit:
        parts.append(f"a page of {limit}: --after for the next")
    return ", ".join(parts)


@durable.command(name="release-key")
@click.argument("run_id")
@click.option("--by", help="Who releases it (recorded in activity).")
@click.pass_context
def release_key(ctx: click.Context, run_id: str, by: str | None) -> None:
    """Free a finished run's key so a new start can take it."""
    or_fail(durable_of(ctx).release_key, run_id, by)
    click.echo(f"{run_id}: key released")


@durable.command()
@click.argument("run_id")
@click.pass_context
def retry(ctx: click.Context, run_id: str) -> None:
    """Resume a failed run from its failed step."""
    or_fail(durable_of(ctx).retry, run_id)
    click.echo(f"{run_id}: retrying")


@durable.command()
@click.argument("run_id")
@click.pass_context
def rerun(ctx: click.Context, run_id: str) -> None:
    """Start a fresh copy of a finished run, with its input and key."""
    new_id = or_fail(durable_of(ctx).rerun, run_id)
    click.echo(f"{run_id}: rerun as {new_id}")


def _run_dict(run: Any) -> dict[str, Any]:
    return asdict(run)


def _key_blocks(d: Durable, run: Any) -> bool:
    """Whether ``run`` holds its key and a new start with that key gets it."""
    from ..observe.activity import key_blocks

    return bool(run.holds_key) and key_blocks(d.workflows, run.workflow, run.status)


def _holds(d: Durable, run: Any) -> str:
    """The "holds" column: yes (its key blocks a new start), free (a finished holder whose key
    the next start takes), - (holds no key)."""
    if not run.holds_key:
        return "-"
    return "yes" if _key_blocks(d, run) else "free"


def _run_fields(d: Durable, run: Any) -> list[tuple[str, str]]:
    """``show``'s label/value lines for one run."""
    fields = [("run", run.id), ("workflow", run.workflow), ("status", run.status)]
    if run.key is not None:
        held = {"yes": "holds it, blocks new starts", "free": "holds it, free to take", "-": "not held"}
        fields.append(("key", f"{run.key} ({held[_holds(d, run)]})"))
    fields += [
        (label, value)
        for label, value in (("parent", run.parent_id), ("runs after", run.runs_after_id))
        if value
    ]
    fields.append(("step", f"{run.step_index}, attempt {run.attempt}"))
    for label, at in (
        ("created", run.created_at),
        ("started", run.started_at),
        ("finished", run.finished_at),
    ):
        fields.append((label, f"{at:%Y-%m-%d %H:%M:%S %Z}" if at else "-"))
    fields += [("input", _short(run.input)), ("context", _short(run.context)), ("output", _short(run.output))]
    if run.error:
        fields.append(("error", f"{run.error.get('type')}: {run.error.get('message')}"))
    return fields


def _short(value: Any, width: int = 200) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 20] + " ... (--json for all)"


# Commands of their own modules, registered on the group here.
for command in (
    cli_schedules.schedules,
    cli_observe.status,
    cli_observe.doctor,
    cli_observe.metrics,
    cli_ops.prune,
    cli_ops.cleanup,
    cli_ops.queues_command,
    cli_ops.pause,
    cli_ops.resume,
    cli_ops.nodes,
    cli_web.web,
    cli_vacuum.tune_vacuum,
    cli_flow.flow,
    cli_bulk.bulk,
):
    durable.add_command(command)
