"""What the benchmarks share: printing as they go, and a database to measure on."""

from __future__ import annotations

import sys

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
