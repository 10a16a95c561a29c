"""``manage.py migrate`` creates durable's tables with the revisions ``celery durable migrate``
runs (one Django migration per Alembic revision), ``migrate durable_celery zero`` removes them,
and either tool follows the other through the one version table."""

from __future__ import annotations

import importlib
import io
import pkgutil
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from durable_celery.store import migrate
from durable_celery.store.schema import SCRIPTS
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


def _django_migrations() -> dict[str, Any]:
    """Each Django migration of the app, by name, in the order its dependencies chain them."""
    from durable_celery.contrib.django import migrations as package

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        found[info.name] = importlib.import_module(f"{package.__name__}.{info.name}").Migration
    after = {}  # each migration's one predecessor in the app: the chain is linear
    for name, migration in found.items():
        (before, *more) = [dep for app, dep in migration.dependencies if app == "durable_celery"] or [None]
        assert not more, f"{name} depends on more than one migration of the app"
        after[before] = name
    chain, name = [], after.get(None)
    while name is not None:
        chain.append(name)
        name = after.get(name)
    assert sorted(chain) == sorted(found), "the app's migrations are not one chain"
    return {name: found[name] for name in chain}


def _revision(operation: Any) -> str | None:
    return getattr(operation, "durable_revision", None)


def _django_twins() -> dict[str, str]:
    """Each Django migration of the app that applies an Alembic revision, and that revision, in
    migration order; the others (no alembic_revision operation) change Django's state only."""
    return {
        name: _revision(migration.operations[0])
        for name, migration in _django_migrations().items()
        if any(_revision(operation) for operation in migration.operations)
    }


def test_every_alembic_revision_has_a_django_twin_in_order():
    for name, migration in _django_migrations().items():
        revisions = [_revision(operation) for operation in migration.operations]
        assert all(revisions) or not any(revisions), f"{name} mixes alembic_revision with other operations"
        assert len(revisions) == 1 or not any(revisions), f"{name} applies more than one revision"
    twins = _django_twins()
    assert list(twins.values()) == [rev for rev, _ in migrate.revisions()], (
        "each Alembic revision needs a Django migration in durable_celery/contrib/django/migrations "
        "whose one operation is alembic_revision(<revision>), in the revisions' order"
    )
    # Named as the revision's file, after the number (Django's numbers run ahead once a
    # state-only migration took one: 0006_read_only_models).
    files = {p.name[:4]: p.stem[5:] for p in (SCRIPTS / "versions").glob("[0-9]*.py")}
    for name, revision in twins.items():
        assert name[5:] == files[revision], f"{name} applies revision {revision} ({files[revision]})"


def test_the_other_migrations_write_no_sql(durable):
    from django.core.management import call_command

    others = [name for name in _django_migrations() if name not in _django_twins()]
    assert "0006_read_only_models" in others
    for name in others:
        out = io.StringIO()
        call_command("sqlmigrate", "durable_celery", name, stdout=out)
        sql = [line for line in out.getvalue().splitlines() if line and not line.startswith("--")]
        assert sql == ["BEGIN;", "COMMIT;"], f"{name} is not state-only: {sql}"
        assert "CANNOT BE WRITTEN" not in out.getvalue(), f"{name} runs Python"


def test_the_models_need_no_new_migration(durable):
    from django.core.management import call_command

    out = io.StringIO()
    call_command("makemigrations", "durable_celery", check=True, dry_run=True, stdout=out)  # exits 1 else
    assert "No changes detected" in out.getvalue()


def test_the_migration_state_has_every_field_of_the_models(durable):
    """makemigrations does not compare an unmanaged model's fields: this does."""
    from django.apps import apps
    from django.db.migrations.loader import MigrationLoader
    from django.db.migrations.state import ModelState

    state = MigrationLoader(None, ignore_no_migrations=True).project_state()
    for model in apps.get_app_config("durable_celery").get_models():
        mine = ModelState.from_model(model)
        recorded = state.models["durable_celery", model._meta.model_name]
        assert {n: f.deconstruct()[1:] for n, f in mine.fields.items()} == {
            n: f.deconstruct()[1:] for n, f in recorded.fields.items()
        }, model.__name__
        assert mine.options == recorded.options, model.__name__


def test_the_models_match_durables_tables(durable):
    """Each model's columns are its table's in schema.py: names, types, nullability."""
    from django.apps import apps
    from django.db import connection
    from sqlalchemy.dialects import postgresql

    from durable_celery.store import schema

    for model in apps.get_app_config("durable_celery").get_models():
        assert model._meta.managed is False, model.__name__
        table = schema.metadata.tables[model._meta.db_table]
        fields = {field.column: field for field in model._meta.concrete_fields}
        assert set(fields) == set(table.columns.keys()), model.__name__
        for column in table.columns:
            field = fields[column.name]
            where = f"{model.__name__}.{field.name}"
            # A key column of a composite primary key is NOT NULL without the field being the pk.
            assert field.null is bool(column.nullable and not column.primary_key), where
            column_type = column.type.compile(dialect=postgresql.dialect())
            assert field.db_type(connection).lower() == column_type.lower(), where
