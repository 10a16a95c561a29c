"""The ``-A`` a ``celery`` command was given, for messages that say what to type next."""

from __future__ import annotations

import os
import sys


def given_app() -> str | None:
    """The ``-A``/``--app`` of this process's command line, else ``CELERY_APP``, else None."""
    argv = sys.argv
    for n, arg in enumerate(argv):
        if arg in ("-A", "--app") and n + 1 < len(argv):
            return argv[n + 1]
        if arg.startswith("--app="):
            return arg.split("=", 1)[1]
        if arg.startswith("-A") and len(arg) > 2:
            return arg[2:]
    return os.environ.get("CELERY_APP")


def app_argument() -> str:
    """The ``-A`` of the command this process runs, ``<app>`` when none was given."""
    given = given_app()
    return "<app>" if given is None else given
