"""What every ``celery -A app durable`` command shares: the Durable of the app given with ``-A``,
and a DurableError turned into a one-line command error."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ..errors import DurableError, NotConfigured
from ..worker.app_argument import given_app

if TYPE_CHECKING:
    from ..app import Durable


def durable_of(ctx: click.Context) -> Durable:
    """The ``Durable`` bound to the app given with ``celery -A``."""
    app = ctx.obj.app if ctx.obj is not None else None
    durable = getattr(app, "_durable", None)
    if durable is None:
        if given_app() is None:
            raise NotConfigured(f"no -A given: run `celery -A yourmodule durable {ctx.info_name} ...`")
        raise NotConfigured("the app given with -A has no Durable(app); create one in its module")
    load_workflows(app)
    return durable


def load_workflows(app: Any) -> None:
    """Import the app's modules as a worker does at start (``include``, ``imports``, the
    modules ``autodiscover_tasks`` finds; in a Django project, after ``django.setup()``), so a
    command knows every workflow they define. Once per process."""
    if not getattr(app, "_durable_modules_loaded", False):
        app.loader.import_default_modules()
        app._durable_modules_loaded = True


def or_fail(fn: Any, *args: Any) -> Any:
    """Call ``fn``; a DurableError becomes a ClickException (its message, exit code 1)."""
    try:
        return fn(*args)
    except DurableError as exc:
        raise click.ClickException(str(exc)) from exc


def reader_of(ctx: click.Context) -> Durable:
    """The ``Durable`` of ``celery -A``, reading its read replica when it has one: for reports."""
    return durable_of(ctx).reader
