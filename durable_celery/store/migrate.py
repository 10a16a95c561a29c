"""Alembic migrations, run from code: ``Durable.migrate()``, ``migrate --check``, and one revision
at a time on a caller's connection (Django's ``manage.py migrate``, contrib/django/migrating.py)."""

from __future__ import annotations

from collections.abc import Callable

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text

from .db import Database
from .schema import SCRIPTS, VERSION_TABLE


def alembic_config(db: Database) -> Config:
    """An Alembic config for our scripts and version table, on ``db``."""
    config = Config()
    config.set_main_option("script_location", str(SCRIPTS))
    config.set_main_option("sqlalchemy.url", db.url.replace("%", "%%"))
    config.attributes["database"] = db
    return config


def head_revision(db: Database) -> str | None:
    """The newest revision the code knows."""
    return ScriptDirectory.from_config(alembic_config(db)).get_current_head()


def current_revision(db: Database) -> str | None:
    """The revision the database is at, or None when it was never migrated."""
    with db.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def pending_revisions(db: Database) -> list[str]:
    """Revisions not yet applied, oldest first."""
    script = ScriptDirectory.from_config(alembic_config(db))
    current = current_revision(db)
    revs = list(script.iterate_revisions("head", current or "base"))
    return [r.revision for r in reversed(revs) if r.revision != current]


def revisions() -> list[tuple[str, str | None]]:
    """Every revision the code knows, oldest first, with the one before it."""
    script = ScriptDirectory(str(SCRIPTS))
    return [(r.revision, r.down_revision) for r in reversed(list(script.walk_revisions()))]  # type: ignore[misc]


def move_on(conn: Connection, revision: str, up: bool) -> bool:
    """On the caller's connection, upgrade to ``revision`` (``up``) or downgrade from it to the
    revision before it, unless the database is already there; returns whether it moved. The
    version table is the one ``Durable.migrate()`` keeps, so either tool can follow the other."""
    order = [rev for rev, _ in revisions()]
    current = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()
    # End SQLAlchemy's implicit transaction of that read (on Django's lent connection the
    # commit is Django's, a no-op here), so Alembic begins and tracks its own: a revision's
    # autocommit_block (indexes built CONCURRENTLY) needs that, in a non-atomic migration.
    conn.commit()
    at = order.index(current) if current in order else -1
    target = order.index(revision)
    config = Config()
    config.set_main_option("script_location", str(SCRIPTS))
    config.attributes["database"] = None
    config.attributes["connection"] = conn
    if up and at < target:
        command.upgrade(config, revision)
        return True
    if not up and at >= target:
        before = dict(revisions())[revision]
        command.downgrade(config, before or "base")
        if before is None:  # back before the first revision: nothing of durable's is left
            conn.execute(text(f"DROP TABLE IF EXISTS {VERSION_TABLE}"))
        return True
    return False


def upgrade(db: Database, progress: Callable[[str], None] | None = None) -> list[str]:
    """Apply every pending revision, reporting each; returns the revisions applied."""
    todo = pending_revisions(db)
    config = alembic_config(db)
    for revision in todo:
        if progress:
            progress(f"applying {revision}")
        command.upgrade(config, revision)
    if progress:
        progress("database is up to date" if not todo else f"applied {len(todo)} revision(s)")
    return todo
