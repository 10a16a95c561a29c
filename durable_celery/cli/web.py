"""``celery -A app durable web``: serve the dashboard (needs the ``[web]`` extra)."""

from __future__ import annotations

import os
import socket

import click

from ..errors import DurableError, InvalidArgument, MissingExtra
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
        raise MissingExtra("web", "the dashboard", str(exc)) from exc
    try:
        check_bind(host, token)
    except DurableError as exc:
        raise click.ClickException(str(exc)) from exc
    durable = durable_of(ctx)
    _ = durable.db.engine  # a URL that cannot work is said now, not on the first page
    listening = _listen(host, port)  # a busy port is said before "serving", not after
    app = create_app(durable, token=token)
    mode = "actions need the token" if token else "read-only (no token)"
    click.echo(f"durable dashboard on http://{host}:{port}/ ({mode})")
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, or InvalidArgument saying why it cannot."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listening = socket.socket(family, socket.SOCK_STREAM)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((host, port))
        listening.listen(128)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot serve the dashboard on {host}:{port}: {exc.strerror or exc}; "
            "is another process using it? choose another with --port"
        ) from exc
    listening.set_inheritable(True)
    return listening
