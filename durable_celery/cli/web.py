"""``celery -A app durable web``: serve the dashboard (needs the ``[web]`` extra)."""

from __future__ import annotations

import os

import click

from ..errors import DurableError
from .common import durable_of


@click.command(name="web")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=5557, show_default=True, type=int, help="Port to listen on.")
@click.option(
    "--token",
    default=None,
    help="Token that actions need (Authorization: Bearer, or log in on the page); also DURABLE_WEB_TOKEN. "
    "Without one the dashboard is read-only.",
)
@click.pass_context
def web(ctx: click.Context, host: str, port: int, token: str | None) -> None:
    """Serve the dashboard: runs, keys, queues, schedules and settings, with actions."""

    token = token or os.environ.get("DURABLE_WEB_TOKEN") or None
    try:
        import uvicorn

        from ..web import create_app
        from ..web.auth import check_bind
    except ImportError as exc:
        raise click.ClickException(
            f"the dashboard needs the web extra: pip install 'durable-celery[web]' ({exc})"
        ) from exc
    try:
        check_bind(host, token)
    except DurableError as exc:
        raise click.ClickException(str(exc)) from exc
    app = create_app(durable_of(ctx), token=token)
    mode = "actions need the token" if token else "read-only (no token)"
    click.echo(f"durable dashboard on http://{host}:{port}/ ({mode})")
    uvicorn.run(app, host=host, port=port, log_level="warning")
