"""``manage.py migrate`` runs durable's Alembic revisions: one Django migration per revision
(``migrations/``), each applying its revision on Django's connection, inside the migration's
transaction, and sharing the version table ``celery durable migrate`` keeps, so either tool can
follow the other. ``migrate durable_celery zero`` steps back to before the first revision."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from ...store import migrate


def alembic_revision(revision: str) -> migrations.RunPython:
    """The operation of the Django migration that applies Alembic revision ``revision``."""

    def forward(apps: Any, schema_editor: Any) -> None:
        _move(schema_editor.connection.alias, revision, up=True)

    def backward(apps: Any, schema_editor: Any) -> None:
        _move(schema_editor.connection.alias, revision, up=False)

    operation = migrations.RunPython(forward, backward, elidable=False)
    operation.durable_revision = revision  # type: ignore[attr-defined]  # the parity test reads it
    return operation


def _move(alias: str, revision: str, up: bool) -> None:
    from .durable import _lending_engine

    with _lending_engine(alias).connect() as conn:
        migrate.move_on(conn, revision, up)
