"""A pytest plugin for mutant runs (``-p tests.mutation.plugin``).

mutmut runs every mutant's tests in a process forked from one that already imported
``tests.conftest``, so its module-level names would be shared by every mutant. The runner makes
one migrated template for the whole run (``DURABLE_MUTATION_TEMPLATE``), used here as the
``pg_template`` fixture; without one, each session's template gets a name of its own. A mutant
stopped for its timeout skips its teardown, so every database a session creates is logged to
``DURABLE_MUTATION_DB_LOG`` and the runner drops those still there at the end. A mutant's
tests run fastest first (by the times mutmut recorded), so a killed mutant dies soon under ``-x``.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

# What a test's setup costs beyond its call (mutmut times only the call): a database clone.
POSTGRES_SETUP = 0.5


def _log_database(name: str) -> None:
    path = os.environ.get("DURABLE_MUTATION_DB_LOG")
    if path:
        with open(path, "a") as log:
            log.write(name + "\n")


def pytest_collection_finish(session: pytest.Session) -> None:
    """A template database of this session's own, whatever the process forked from."""
    conftest = sys.modules.get("tests.conftest")
    if conftest is not None and not os.environ.get("DURABLE_MUTATION_TEMPLATE"):
        conftest.TEMPLATE = f"durable_test_template_{uuid.uuid4().hex[:10]}"
        _log_database(conftest.TEMPLATE)


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Any:
    """``pg_template`` is the run's template (``DURABLE_MUTATION_TEMPLATE``), made and migrated
    once by the runner: a session per mutant need not build its own."""
    template = os.environ.get("DURABLE_MUTATION_TEMPLATE")
    if template and fixturedef.argname == "pg_template":
        fixturedef.cached_result = (template, fixturedef.cache_key(request), None)
        return template
    return None


@pytest.hookimpl(hookwrapper=True, specname="pytest_fixture_setup")
def log_test_databases(fixturedef: Any, request: Any) -> Any:
    outcome = yield
    if fixturedef.argname == "pg_url" and outcome.excinfo is None:
        _log_database(str(outcome.get_result()).rsplit("/", 1)[-1])


def pytest_collection_modifyitems(session: pytest.Session, config: Any, items: list[Any]) -> None:
    """Fastest tests first, by mutmut's recorded call times (run from its ``mutants`` folder)."""
    stats = Path("mutmut-stats.json")
    if not stats.exists():
        return
    try:
        durations = json.loads(stats.read_text())["duration_by_test"]
    except (ValueError, KeyError):
        return

    def cost(item: Any) -> float:
        setup = POSTGRES_SETUP if "postgres" in item.nodeid else 0.0
        return float(durations.get(item.nodeid, 1.0)) + setup

    items.sort(key=cost)
