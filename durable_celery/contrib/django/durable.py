"""``DjangoDurable``: a ``Durable`` whose database is a Django alias and whose starts join Django's
transaction; ``django_connection``: that transaction, for ``start(..., connection=...)``.

Durable keeps its own pool on the alias's database (workers, the relay, starts outside a
transaction). Inside ``transaction.atomic()`` on the alias, a start writes the run and its key
claim on Django's own connection instead, so they commit or roll back with the caller's rows
(savepoints included), and the first message is sent from ``transaction.on_commit``.

Django's connection is lent to SQLAlchemy, never owned by it: SQLAlchemy's commit, rollback and
close do nothing on it (Django's ``atomic`` decides), and JSON columns are read as dicts by the
cursors durable opens, while Django's own cursors keep Django's JSON handling.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from celery import Celery
from celery import signals as celery_signals
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.pool import NullPool

from ...app import Durable
from ...capabilities import Capability
from ...core.runtime import Outbox
from ...errors import InvalidArgument, NotConfigured, SchemaOutdated
from ...store.db import Database, limit_transaction_txn, masked_url, schema_missing, short_reason
from .aliases import UNUSABLE_URL, AliasProblem, alias_url, migrate_fix, settings_dict

DEFAULT_ALIAS = "default"


class DjangoDurable(Durable):
    """A ``Durable`` on a Django database alias (``CELERY_DURABLE_DATABASE_ALIAS``, default
    ``"default"``); every durable setting may be given as ``CELERY_DURABLE_<NAME>``.

    Create it in ``proj/celery.py`` after ``app.config_from_object("django.conf:settings",
    namespace="CELERY")``; Django's app registry need not be ready. With
    ``CELERY_DURABLE_JOIN_ATOMIC`` (default True) a start inside ``transaction.atomic()`` on the
    alias joins Django's transaction. ``CELERY_DURABLE_READ_DATABASE_ALIAS`` names a streaming
    replica's alias for what operators read (the admin, the dashboard, reports, metrics).
    """

    def __init__(
        self,
        app: Celery,
        *,
        capabilities: Capability = Capability.ALL,
        outbox: Outbox | None = None,
        **settings: Any,
    ) -> None:
        alias = (
            settings.pop("database_alias", None) or app.conf.get("durable_database_alias") or DEFAULT_ALIAS
        )
        join = settings.pop("join_atomic", None)
        join = app.conf.get("durable_join_atomic") if join is None else join
        self.alias: str = alias
        self.join_atomic: bool = True if join is None else bool(join)
        read_alias = settings.pop("read_database_alias", None) or app.conf.get("durable_read_database_alias")
        self.read_alias: str = read_alias or alias
        pool_size = settings.get("pool_size", app.conf.get("durable_pool_size") or 5)
        database = DjangoDatabase(alias, pool_size=pool_size)
        super().__init__(
            app,
            database.url,
            capabilities=capabilities,
            outbox=outbox,
            database=database,
            read_database=DjangoDatabase(read_alias, pool_size=pool_size) if read_alias else None,
            **settings,
        )
        self.starter.ambient = self._open_atomic_block
        _made[alias] = self
        if read_alias:
            _reading[read_alias] = self  # the admin's actions on rows read there write here
        _discover_workflows(app)
        from . import checks

        checks.register(_made)
        celery_signals.worker_init.connect(checks.log_at_worker_start, weak=False, dispatch_uid=checks.ALIAS)

    def _open_atomic_block(self) -> DjangoTransaction | None:
        """Django's transaction on the alias, when a start runs inside ``atomic()``."""
        if not self.join_atomic:
            return None
        from django.db import connections

        if not connections[self.alias].in_atomic_block:
            return None
        return django_connection(self.alias)


def _discover_workflows(app: Celery) -> None:
    """Import each installed app's ``workflows`` module when Celery imports its modules (a
    worker at start, every ``celery -A proj durable`` command), as it does for ``tasks``."""

    def installed() -> list[str]:
        from django.apps import apps

        return [config.name for config in apps.get_app_configs()]

    app.autodiscover_tasks(installed, related_name="workflows")


# The DjangoDurable made last for each alias: what the admin's actions call.
_made: dict[str, DjangoDurable] = {}
# The same, by the alias of its read replica.
_reading: dict[str, DjangoDurable] = {}


def durable_for(alias: str = DEFAULT_ALIAS) -> DjangoDurable:
    """The ``DjangoDurable`` of alias ``alias`` (the one made last), or of which ``alias`` is the read
    replica; NotConfigured if none was."""
    found = _made.get(alias) or _reading.get(alias)
    if found is None:
        raise NotConfigured(
            f"no DjangoDurable on database alias {alias!r}: create DjangoDurable(app) in your Celery "
            "module (proj/celery.py) and make sure Django imports it (proj/__init__.py)"
        )
    return found


def django_connection(using: str = DEFAULT_ALIAS) -> DjangoTransaction:
    """Django's transaction on alias ``using``, for ``start(..., connection=django_connection())``:
    the run is written on Django's connection and its first message sent on commit."""
    return DjangoTransaction(using)


class DjangoTransaction:
    """Django's current transaction on one alias, as a start joins it (``JoinedTransaction``)."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """A SQLAlchemy connection over Django's own connection of this thread; InvalidArgument
        outside ``transaction.atomic()`` on the alias (durable's own pool serves that case)."""
        from django.db import connections

        if not connections[self.alias].in_atomic_block:
            raise InvalidArgument(
                f"connection=django_connection({self.alias!r}) must be inside transaction.atomic(using="
                f"{self.alias!r}); outside it, start() without connection= commits on its own"
            )
        with _lending_engine(self.alias).connect() as conn:
            yield conn

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once Django commits (at once outside ``atomic()``); an error in it is
        logged by Django, and a message it could not send is left to the relay."""
        from django.db import transaction

        transaction.on_commit(fn, using=self.alias, robust=True)


class DjangoDatabase(Database):
    """Durable's database on a Django alias: its own pool on the alias's database, following
    Django when it switches the alias to a test database (``manage.py test``, pytest-django)."""

    def __init__(self, alias: str, *, pool_size: int = 5) -> None:
        self.alias = alias
        self._settings_name: Any = None
        # An alias durable cannot use is a system check's error (checks.py) and NotConfigured at
        # first use, never an error at import: every manage.py command must still run.
        try:
            url, self.problem = alias_url(alias), None
        except AliasProblem as exc:
            url, self.problem = UNUSABLE_URL, exc
        super().__init__(url, pool_size=pool_size)
        if self.problem is None:
            self._settings_name = settings_dict(alias).get("NAME")
        else:
            self.bad_url = str(self.problem)

    @property  # type: ignore[override]
    def migrate_fix(self) -> str:
        """How to create or upgrade durable's tables in this project (read when needed)."""
        return migrate_fix()

    @migrate_fix.setter
    def migrate_fix(self, _value: str | None) -> None:
        """Database.__init__'s default is not this project's: ignored."""

    @property
    def engine(self) -> Engine:
        """The engine on the alias's database now (a new one once Django switched databases);
        NotConfigured when the alias cannot be used."""
        if self.problem is not None:
            raise NotConfigured(str(self.problem))
        name = settings_dict(self.alias).get("NAME")
        if name != self._settings_name:
            with self._lock:
                if name != self._settings_name:
                    self._follow(name)
        return Database.engine.fget(self)  # type: ignore[attr-defined,no-any-return]

    def same_database(self, where: Any) -> bool:
        """Is ``where`` this alias (a Django alias is another database, even on one server: its
        writes go on another connection), or an Engine or URL of its database?"""
        from django.conf import settings

        if isinstance(where, str) and where in getattr(settings, "DATABASES", {}):
            return where == self.alias
        return super().same_database(where)

    @contextmanager
    def step_transaction(self, timeout: float | None, idle: float) -> Iterator[Connection]:
        """An atomic step's transaction: ``transaction.atomic(using=alias)`` on this thread's
        Django connection, so the step's ORM writes on the alias are in it, as is durable's
        record of the step (written on the same connection)."""
        from django.db import transaction

        with transaction.atomic(using=self.alias), _lending_engine(self.alias).connect() as conn:
            limit_transaction_txn(conn, timeout, idle)
            yield conn

    def _follow(self, name: Any) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
        self.url = alias_url(self.alias)
        self._settings_name = name


_lenders: dict[tuple[str, str], Engine] = {}
_lenders_lock = threading.Lock()


def _lending_engine(alias: str) -> Engine:
    """A SQLAlchemy engine whose connection is Django's own connection of the calling thread."""
    url = alias_url(alias)
    key = (alias, url)
    engine = _lenders.get(key)
    if engine is None:
        with _lenders_lock:
            engine = _lenders.get(key)
            if engine is None:

                def lend() -> Lent:
                    from django.db import connections

                    connection = connections[alias]
                    connection.ensure_connection()
                    return Lent(connection.connection)

                engine = create_engine(
                    url,
                    creator=lend,
                    poolclass=NullPool,  # nothing kept: each checkout lends the thread's connection
                    use_native_hstore=False,  # no type lookup on a connection SQLAlchemy does not own
                    hide_parameters=True,
                )
                event.listen(engine, "handle_error", partial(_schema_outdated, masked_url(url)))
                _lenders[key] = engine
    return engine


def _schema_outdated(url: str, context: ExceptionContext) -> None:
    """A missing durable table or column on Django's connection: SchemaOutdated with this
    project's fix, not the driver's ProgrammingError."""
    if schema_missing(context.original_exception):
        raise SchemaOutdated(url, short_reason(context.original_exception), migrate_fix())


class Lent:
    """Django's psycopg connection as SQLAlchemy sees it: statements and cursors pass through;
    commit, rollback and close are Django's to do, so here they do nothing. Cursors opened here
    read JSON as Python values; Django's own cursors keep Django's loaders."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        """A cursor on Django's connection that reads json and jsonb as Python values."""
        from psycopg.types.json import JsonbLoader, JsonLoader

        cursor = self._raw.cursor(*args, **kwargs)
        cursor.adapters.register_loader("jsonb", JsonbLoader)
        cursor.adapters.register_loader("json", JsonLoader)
        return cursor

    def commit(self) -> None:
        """Django commits."""

    def rollback(self) -> None:
        """Django rolls back."""

    def close(self) -> None:
        """Django closes its connection."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)
