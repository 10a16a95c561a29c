"""What the benchmarks share: printing as they go, and a database to measure on."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import click
import redis
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


def _spare_port() -> int:
    """A port in 20000-29999 that nothing listens on now (below the ephemeral range)."""
    for port in random.sample(range(20000, 30000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999 for the bench's redis-server")


@contextmanager
def private_redis(url: str | None = None) -> Iterator[str]:
    """A broker URL for a bench: ``url`` as given (never flushed: the bench deletes only its own
    keys), or a ``redis-server`` of its own on a spare port, without persistence, stopped after.

    Benches must not flush a database of the shared server: other people's tests use it.
    """
    if url:
        yield url
        return
    port = _spare_port()
    folder = tempfile.mkdtemp(prefix="durable-bench-redis-")
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", folder]
    proc = subprocess.Popen(["redis-server", *args], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the bench's redis-server on port {port} did not start") from None
                time.sleep(0.05)
            finally:
                client.close()
        say(f"started redis-server on 127.0.0.1:{port} (stopped at the end)")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
