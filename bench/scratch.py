"""Scratch databases for the operations benchmarks: created fresh, migrated, dropped after."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from celery import Celery
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from bench.common import say
from durable_celery import Durable
from durable_celery.store.db import normalize_url

SERVER = "postgresql://postgres@127.0.0.1:5432"
TABLES = ("durable_runs", "durable_steps", "durable_keys", "durable_events", "durable_activity")


@contextmanager
def scratch_database(server: str, prefix: str, keep: bool = False) -> Iterator[str]:
    """A new migrated database named ``<prefix>_<random>`` on ``server``, dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    base = make_url(normalize_url(f"{server.rstrip('/')}/postgres"))
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    url = base.set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    say(f"created database {name}")
    try:
        durable = Durable(Celery("scratch", broker="memory://"), url, upkeep=False)
        durable.migrate()
        durable.db.dispose()
        yield url
    finally:
        if keep:
            say(f"kept database {name}")
        else:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            say(f"dropped database {name}")
        admin.dispose()


class Timer:
    """Seconds since it was made, for progress lines."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __str__(self) -> str:
        return f"{time.perf_counter() - self.t0:6.1f}s"
