"""A real Django project (tests/django/project) on a PostgreSQL database of this session, with
a Redis broker: Django is set up once per test process, its tables migrated with ``migrate``."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import PG_HOST, _admin


@pytest.fixture(scope="session")
def django_project(pg_template: str, redis_server: str) -> Iterator[Any]:
    """The project's Durable, once Django is set up on a database of this session."""
    name = f"durable_t_dj_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {pg_template}")
    where = urlsplit(PG_HOST)
    os.environ.update(
        DJANGO_SETTINGS_MODULE="tests.django.project.settings",
        DURABLE_DJANGO_DB=name,
        DURABLE_DJANGO_USER=where.username or "postgres",
        DURABLE_DJANGO_HOST=where.hostname or "127.0.0.1",
        DURABLE_DJANGO_PORT=str(where.port or 5432),
        DURABLE_DJANGO_BROKER=redis_server,
        DURABLE_DJANGO_QUEUE=f"q-dj-{uuid.uuid4().hex[:8]}",
    )
    import django
    from django.core.management import call_command
    from django.db import connections

    django.setup()
    call_command("migrate", verbosity=0)
    import tests.django.shop.workflows  # noqa: F401  (defines the shop's workflows)
    from tests.django.project.celery import durable

    try:
        yield durable
    finally:
        durable.flush(timeout=10)
        durable.db.dispose()
        connections.close_all()
        with _admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def durable(django_project: Any) -> Any:
    """The project's DjangoDurable (``tests/django/project/celery.py``)."""
    return django_project
