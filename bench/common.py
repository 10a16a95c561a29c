"""What the benchmarks share: printing as they go, and a database to measure on."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import click
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from durable_celery.store.db import normalize_url


def run_id_sql(created: str) -> str:
    """SQL for a run id like the library's (``durable_celery.app.new_run_id``: a version 7
    UUID, time-ordered) made at ``created``, a SQL timestamp; for bulk-loaded runs."""
    return (
        f"CAST(lpad(to_hex(floor(extract(epoch FROM {created}) * 1000)::bigint), 12, '0')"
        " || '7' || substr(md5(random()::text), 1, 3) || '8' || substr(md5(random()::text), 1, 15)"
        " AS uuid)::text"
    )


def say(message: str) -> None:
    """Print a line at once (progress shows while a benchmark runs)."""
    click.echo(message)
    sys.stdout.flush()


def prepare_database(url: str, fresh: bool = False) -> str:
    """Create the database if it is missing (or anew); returns the URL pinned to psycopg 3."""
    parsed = make_url(normalize_url(url))
    quoted = '"' + (parsed.database or "").replace('"', '""') + '"'
    admin = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if fresh:
                say(f"dropping database {parsed.database}")
                conn.execute(text(f"DROP DATABASE IF EXISTS {quoted} WITH (FORCE)"))
            found = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": parsed.database}
            ).scalar()
            if not found:
                say(f"creating database {parsed.database}")
                conn.execute(text(f"CREATE DATABASE {quoted}"))
    finally:
        admin.dispose()
    return parsed.render_as_string(hide_password=False)


@contextmanager
def private_redis() -> Iterator[str]:
    """A ``redis-server`` of this process on a spare port (no persistence), stopped on exit;
    yields its URL. Nothing on a shared Redis is touched."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="bench-redis-")
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", folder],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise click.ClickException("redis-server did not start (is it on the PATH?)") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
