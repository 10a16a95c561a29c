"""A Django database alias as durable sees it: the SQLAlchemy URL it makes, or what is wrong
with it (``AliasProblem``: what, and the fix), and how this project migrates durable's tables."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import URL

from ...errors import NotConfigured

APP = "durable_celery.contrib.django"

# Where a DjangoDatabase points while its alias cannot be used (never connected to).
UNUSABLE_URL = "postgresql+psycopg:///durable_alias_not_usable"


class AliasProblem(NotConfigured):
    """A database alias durable cannot use: what is wrong (``what``) and the fix (``fix``)."""

    def __init__(self, what: str, fix: str) -> None:
        self.what, self.fix = what, fix
        super().__init__(f"durable: {what}; fix: {fix}")

    def __reduce__(self) -> tuple[type[AliasProblem], tuple[str, str]]:
        return (type(self), (self.what, self.fix))


def migrate_fix() -> str:
    """How to create or upgrade durable's tables in this Django project."""
    if app_installed():
        return "run `python manage.py migrate`"
    return f"add {APP!r} to INSTALLED_APPS, then run `python manage.py migrate`"


def app_installed() -> bool:
    """Is durable's Django app in INSTALLED_APPS (by name or by its AppConfig's path)?"""
    from django.conf import settings

    try:
        entries = list(settings.INSTALLED_APPS)
    except Exception:  # settings not configured
        return False
    return any(entry == APP or entry.startswith(f"{APP}.apps.") for entry in entries)


def settings_dict(alias: str) -> dict[str, Any]:
    """The alias's settings as Django uses them now (its test database's name once switched)."""
    from django.conf import settings

    try:
        from django.db import connections

        return connections[alias].settings_dict  # type: ignore[no-any-return]
    except Exception:  # settings not configured yet, or the alias is unknown
        databases = getattr(settings, "DATABASES", {})
        if alias not in databases:
            there = ", ".join(repr(name) for name in databases) or "none"
            raise AliasProblem(
                f"CELERY_DURABLE_DATABASE_ALIAS is {alias!r}, which is not in DATABASES (aliases: {there})",
                "set CELERY_DURABLE_DATABASE_ALIAS to the alias of a PostgreSQL database in DATABASES",
            ) from None
        return databases[alias]  # type: ignore[no-any-return]


def alias_url(alias: str) -> str:
    """A SQLAlchemy URL (psycopg 3) for the alias; AliasProblem unless it is PostgreSQL on psycopg 3."""
    given = settings_dict(alias)
    engine = given.get("ENGINE", "")
    if "postgresql" not in engine and "postgis" not in engine:
        raise AliasProblem(
            f"durable needs PostgreSQL, and DATABASES[{alias!r}] uses {engine or 'no ENGINE'}",
            f"set DATABASES[{alias!r}]['ENGINE'] to 'django.db.backends.postgresql' (psycopg 3 is "
            "installed with durable-celery), or set CELERY_DURABLE_DATABASE_ALIAS to a PostgreSQL alias",
        )
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3:
        raise AliasProblem(
            f"durable needs psycopg 3, and DATABASES[{alias!r}] runs on psycopg2",
            "pip install 'psycopg[binary]' (Django takes psycopg 3 when it is installed)",
        )
    options = given.get("OPTIONS") or {}
    query = {k: str(v) for k, v in options.items() if k in _URL_OPTIONS and v is not None}
    url = URL.create(
        "postgresql+psycopg",
        username=given.get("USER") or None,
        password=given.get("PASSWORD") or None,
        host=given.get("HOST") or None,
        port=int(given["PORT"]) if given.get("PORT") else None,
        database=given.get("NAME") or None,
        query=query,
    )
    return url.render_as_string(hide_password=False)


# libpq connection options a Django alias may give in OPTIONS that durable's pool uses too.
_URL_OPTIONS = (
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "connect_timeout",
    "application_name",
    "options",
    "target_session_attrs",
)
