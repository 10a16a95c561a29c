"""Django system checks for durable (``manage.py check``, and every command that runs checks):
a ``DjangoDurable`` whose app is not installed, or whose database alias durable cannot use, is
one error each, with the fix as its hint. A worker logs the same lines when it starts."""

from __future__ import annotations

import logging
from typing import Any

from django.core import checks

from .aliases import APP, AliasProblem, app_installed

log = logging.getLogger("durable_celery")

# The DjangoDurables made in this process, by alias (durable.py's registry, given to register).
_made: dict[str, Any] = {}

NOT_INSTALLED = "durable_celery.E001"
ALIAS = "durable_celery.E002"


def durable_checks(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The errors of every DjangoDurable made in this process (none when all is well)."""
    found: list[checks.CheckMessage] = []
    if _made and not app_installed():
        found.append(
            checks.Error(
                f"DjangoDurable is set up but {APP!r} is not in INSTALLED_APPS: `migrate` skips "
                "durable's tables and starts inside atomic() fail",
                hint=f"add {APP!r} to INSTALLED_APPS, then run `python manage.py migrate`",
                id=NOT_INSTALLED,
            )
        )
    for durable in list(_made.values()):
        for database in dict.fromkeys([durable.db, durable.reads]):  # the read replica's alias too
            problem = getattr(database, "problem", None)
            if isinstance(problem, AliasProblem):
                found.append(checks.Error(problem.what, hint=problem.fix, id=ALIAS))
    return found


def register(made: dict[str, Any]) -> None:
    """Add durable's checks, on the DjangoDurables of ``made``, to Django's registry (once:
    the registry keeps a set)."""
    global _made
    _made = made
    checks.register(durable_checks)


def log_at_worker_start(**_: Any) -> None:
    """Log durable's check errors in a starting worker, one line each (an alias durable cannot
    use also stops the worker, saying so once: not repeated here)."""
    for message in durable_checks():
        if message.id != ALIAS:
            log.error("durable: %s; fix: %s", message.msg, message.hint)
