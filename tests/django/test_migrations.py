"""``manage.py migrate`` creates durable's tables with the revisions ``celery durable migrate``
runs (one Django migration per Alembic revision), ``migrate durable_celery zero`` removes them,
and either tool follows the other through the one version table."""

from __future__ import annotations

import importlib
import pkgutil
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from durable_celery.store import migrate
from tests.conftest import _admin


@pytest.fixture
def empty_database(durable: Any) -> Iterator[str]:
    """The alias switched to an empty database (no table at all) for the test."""
    from django.db import connections

    settings = connections["default"].settings_dict
    home, name = settings["NAME"], f"durable_t_dj_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    connections["default"].close()
    settings["NAME"] = name
    try:
        yield name
    finally:
        connections["default"].close()
        settings["NAME"] = home
        durable.db.dispose()
        with _admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _tables() -> set[str]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {row[0] for row in cursor.fetchall() if row[0].startswith("durable_")}


def _migrate(*args: str) -> None:
    from django.core.management import call_command

    call_command("migrate", "durable_celery", *args, verbosity=0)


def test_migrate_creates_the_tables_and_zero_removes_them(durable, empty_database):
    assert durable.pending_migrations() == [rev for rev, _ in migrate.revisions()]
    _migrate()
    assert {"durable_runs", "durable_steps", "durable_keys", "durable_alembic_version"} <= _tables()
    assert durable.pending_migrations() == []
    run_id = durable.start("fulfil", {"order_id": 1})
    assert durable.get_run(run_id).status == "pending"
    _migrate("zero")
    assert _tables() == set()


def test_either_tool_follows_the_other(durable, empty_database):
    first, *rest = [rev for rev, _ in migrate.revisions()]
    _migrate(_django_name(first))  # Django applies the first one
    assert durable.pending_migrations() == rest
    durable.migrate()  # celery durable migrate applies the rest
    assert durable.pending_migrations() == []
    _migrate()  # Django records the rest as applied, changing nothing
    assert durable.pending_migrations() == []
    _migrate("zero")
    assert _tables() == set()
    durable.migrate()  # and from nothing again with Alembic alone
    assert durable.pending_migrations() == []


def _django_name(revision: str) -> str:
    return next(name for name, rev in _django_twins().items() if rev == revision)


def _django_twins() -> dict[str, str]:
    """Each Django migration of the app and the Alembic revision it applies."""
    from durable_celery.contrib.django import migrations as package

    twins = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        (operation,) = module.Migration.operations
        twins[info.name] = operation.durable_revision
    return twins


def test_every_alembic_revision_has_a_django_twin_in_order():
    twins = _django_twins()
    assert sorted(twins.values()) == [rev for rev, _ in migrate.revisions()], (
        "each Alembic revision needs a Django migration in durable_celery/contrib/django/migrations "
        "whose one operation is alembic_revision(<revision>)"
    )
    for name, revision in twins.items():
        assert name.startswith(revision + "_"), f"{name} applies revision {revision}"
