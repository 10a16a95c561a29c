"""The package's shape, as users and readers meet it: every dotted path the docs and config name
resolves, the public names are the ones promised, and no module grows past 600 lines."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from celery.utils.imports import symbol_by_name

import durable_celery

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "durable_celery"
MAX_LINES = 600

# Paths users write in config and imports; they must keep working whatever moves inside.
DOCUMENTED = [
    "durable_celery.beat:DurableScheduler",
    "durable_celery.broker_reconnect:Consumer",
    "durable_celery.cli:durable",
    "durable_celery.pytest_plugin",
    "durable_celery.testing:Fake",
    "durable_celery.testing:RecordingOutbox",
    "durable_celery.testing:run_context",
    "durable_celery.testing:wait_for",
    "durable_celery.testing:worker",
    "durable_celery.web:create_app",
    "durable_celery.logs:bind",
    "durable_celery.waits:EventTimeout",
    "durable_celery.errors:EventTimeout",
    "durable_celery.errors:DurableError",
    "durable_celery.signals:run_finished",
    # Celery builds a step task's request from this string (worker/tasks.py).
    "durable_celery.worker.task_states:StateRequest",
]

PUBLIC = [
    "Durable",
    "Capability",
    "durable_workflow",
    "current_run",
    "RunContext",
    "SendEvent",
    "Step",
    "Workflow",
    "Run",
    "StepRecord",
    "Schedule",
    "DurableError",
    "EventTimeout",
    "ChildFailed",
    "DatabaseUnavailable",
    "InvalidArgument",
    "InvalidDefinition",
    "InvalidKey",
    "InvalidStart",
    "KeyContended",
    "KeyTaken",
    "NoKey",
    "NotConfigured",
    "NotFinished",
    "RateLimited",
    "ResultTimeout",
    "RunCancelled",
    "RunFailed",
    "RunNotFound",
    "RunStopped",
    "ScheduleNotFound",
    "StepTimeout",
    "UnknownWorkflow",
    "Unsupported",
    "WorkerLost",
]

MENTIONED = re.compile(r"durable_celery(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")


def _mentioned_in_docs() -> list[str]:
    """Every ``durable_celery.x.y`` the README and docs name (mutmut's mutant names excepted)."""
    found: set[str] = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found.update(MENTIONED.findall(page.read_text()))
    # Django system check ids (durable_celery.E001) are ids, not paths: checks.py defines them.
    checks = re.compile(r"durable_celery\.[EW]\d{3}")
    return sorted(p for p in found if not p.rsplit(".", 1)[-1].startswith("x_") and not checks.fullmatch(p))


def _resolve(path: str) -> object:
    """A module, or an attribute of one, from ``pkg.mod:attr`` (as Celery reads config strings)
    or ``pkg.mod.attr`` (as the docs name things)."""
    if ":" in path:
        return symbol_by_name(path)
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, attr = path.rpartition(".")
        return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("path", DOCUMENTED)
def test_every_documented_dotted_path_resolves(path):
    assert _resolve(path) is not None


@pytest.mark.parametrize("path", _mentioned_in_docs())
def test_every_path_the_docs_name_resolves(path):
    assert _resolve(path) is not None


def test_the_public_names_are_the_promised_ones():
    assert sorted(durable_celery.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(durable_celery, name) is not None


def test_no_module_is_over_600_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.parts and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these modules (over {MAX_LINES} lines): {long}"


# SQLAlchemy's statement builders and the tables' columns: only the store writes SQL.
_SQL = re.compile(
    r"from sqlalchemy(\.sql)? import [^\n]*\b(select|update|insert|delete|text|case|or_|and_|func)\b"
    r"|\b(runs|steps|keys|activity|events|queues|nodes)\.c\."
)


def test_every_statement_is_in_the_store():
    """Plans are reviewed in one place: no module outside durable_celery/store builds SQL."""
    outside = {
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if "store" not in path.relative_to(PACKAGE).parts[:1] and _SQL.search(path.read_text())
    }
    assert outside == set(), f"move these modules' statements into durable_celery/store: {outside}"
