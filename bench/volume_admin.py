"""The Django admin's changelists on a volume database, in a process of its own (Django's
settings are per process): ``python -m bench.volume_admin --db bench_volume_10m``.

Django is configured here (``settings.configure``: the admin, auth, contenttypes, messages and
``durable_celery.contrib.django`` on the database given) and a ``DjangoDurable`` made on it with
the bench's workflows. Each view is requested once untimed, then timed once: a ``RequestFactory``
request by a staff user with every permission (no session, no tables of Django's own needed), the
view resolved from the admin's URLs and its ``TemplateResponse`` rendered. Prints one JSON line:
``{"times": {view: ms}}``, with ``--statements`` also every SQL statement each view sent (its
text and parameters, for the plan guard).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from bench.volume_build import SERVER
from bench.volume_ops import SAMPLE

RUNS = "/admin/durable_celery/durablerun/"
VIEWS = (
    ("admin: runs changelist", RUNS),
    ("admin: runs ?status=failed", RUNS + "?status__exact=failed"),
    ("admin: runs ?workflow=order", RUNS + "?workflow__exact=order"),
    ("admin: runs search key", RUNS + "?q={completed_key}"),
    ("admin: run page", RUNS + "{completed}/change/"),
    ("admin: keys changelist", "/admin/durable_celery/durablekey/"),
    ("admin: steps changelist", "/admin/durable_celery/durablestep/"),
    ("admin: activity changelist", "/admin/durable_celery/durableactivity/"),
    ("admin: schedules changelist", "/admin/durable_celery/durableschedule/"),
)

urlpatterns: list[Any] = []


def configure(database: str, server: str) -> Any:
    """Set Django up on ``database``; returns the DjangoDurable made on it."""
    from urllib.parse import urlsplit

    import django
    from django.conf import settings

    where = urlsplit(server)
    settings.configure(
        DEBUG=False,
        USE_TZ=True,
        SECRET_KEY="bench-volume",
        ROOT_URLCONF=__name__,
        ALLOWED_HOSTS=["*"],
        STATIC_URL="/static/",
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.messages",
            "durable_celery.contrib.django",
        ],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": database,
                "USER": where.username or "postgres",
                "HOST": where.hostname or "127.0.0.1",
                "PORT": str(where.port or 5432),
            }
        },
        TEMPLATES=[
            {
                "BACKEND": "django.template.backends.django.DjangoTemplates",
                "APP_DIRS": True,
                "OPTIONS": {
                    "context_processors": [
                        "django.template.context_processors.request",
                        "django.contrib.auth.context_processors.auth",
                        "django.contrib.messages.context_processors.messages",
                    ]
                },
            }
        ],
    )
    django.setup()
    from celery import Celery
    from django.contrib import admin
    from django.urls import path

    from bench.volume_app import define
    from durable_celery.contrib.django import DjangoDurable

    urlpatterns[:] = [path("admin/", admin.site.urls)]
    durable = DjangoDurable(Celery("bench_volume_admin", broker="memory://"), upkeep=False)
    define(durable)
    return durable


def staff_user() -> Any:
    """A staff superuser that exists only in this process (no auth tables read)."""
    from django.contrib.auth.models import AnonymousUser

    class Staff(AnonymousUser):
        """Every permission, logged in."""

        id = pk = 1
        username = "bench"
        is_staff = is_superuser = is_active = True

        @property
        def is_anonymous(self) -> bool:  # type: ignore[override]
            """Logged in."""
            return False

        @property
        def is_authenticated(self) -> bool:  # type: ignore[override]
            """Logged in."""
            return True

        def has_perm(self, perm: str, obj: Any = None) -> bool:
            """Every permission."""
            return True

        def has_module_perms(self, module: str) -> bool:
            """Every app."""
            return True

        def get_username(self) -> str:
            """The bench."""
            return "bench"

    return Staff()


def content_types() -> None:
    """Content types of durable's models, cached without their table (a run's page asks)."""
    from django.apps import apps
    from django.contrib.contenttypes.models import ContentType

    for number, model in enumerate(apps.get_app_config("durable_celery").get_models(), 1):
        found = ContentType(pk=number, app_label=model._meta.app_label, model=model._meta.model_name)
        ContentType.objects._add_to_cache("default", found)  # type: ignore[attr-defined]


def sample() -> dict[str, str]:
    """The runs the views show (as volume_ops picks them)."""
    from django.db import connection

    found = {}
    with connection.cursor() as cursor:
        for name, sql in SAMPLE.items():
            cursor.execute(sql)
            row = cursor.fetchone()
            found[name], found[f"{name}_key"] = row[0], row[1]
    return found


def request(path: str, user: Any) -> float:
    """GET ``path`` through the admin's view, rendered; milliseconds. 200 expected."""
    from django.contrib.messages.storage.cookie import CookieStorage
    from django.test import RequestFactory
    from django.urls import resolve

    began = time.perf_counter()
    req = RequestFactory().get(path)
    req.user = user
    req._messages = CookieStorage(req)  # type: ignore[attr-defined]
    match = resolve(req.path_info)
    response = match.func(req, *match.args, **match.kwargs)
    if hasattr(response, "render"):
        response.render()
    if response.status_code != 200:
        raise RuntimeError(f"GET {path}: {response.status_code}")
    return (time.perf_counter() - began) * 1000


@click.command()
@click.option("--db", "database", required=True, help="A volume database.")
@click.option("--statements", is_flag=True, help="Also print each view's SQL statements.")
@click.option("--server", default=SERVER, show_default=True)
def main(database: str, statements: bool, server: str) -> None:
    """Time each admin changelist (and a run's page) once after one untimed request."""
    configure(database, server)
    content_types()
    from django.db import connection

    user, ids = staff_user(), sample()
    times: dict[str, float] = {}
    sent: dict[str, list[Any]] = {}
    for name, pattern in VIEWS:
        path = pattern.format(**ids)
        request(path, user)
        seen: list[Any] = []

        def keep(
            execute: Any, sql: str, params: Any, many: bool, context: Any, seen: list[Any] = seen
        ) -> Any:
            """Django's execute wrapper: note the statement, then send it."""
            seen.append((sql, params[0] if many and params else params))
            return execute(sql, params, many, context)

        with connection.execute_wrapper(keep):
            times[name] = request(path, user)
        sent[name] = seen
    out: dict[str, Any] = {"times": times}
    if statements:
        out["statements"] = sent
    sys.stdout.write(json.dumps(out, default=str) + "\n")


if __name__ == "__main__":
    main()
