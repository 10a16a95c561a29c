"""Fixtures of the chaos suite: one private PostgreSQL server for the module (every scenario
clones its own database from a migrated template on it), and the chaos table printed at the end
of the run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.chaos.checks import Report, table
from tests.chaos.cluster import chaos_server
from tests.pgserver import PgServer

REPORTS: list[Report] = []


@pytest.fixture(scope="session")
def chaos_pg() -> Iterator[PgServer]:
    """A PostgreSQL server of the chaos suite's own, which its scenarios stop and restart."""
    server = chaos_server()
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def chaos_reports() -> list[Report]:
    """Where each scenario leaves its report, for the table at the end of the run."""
    return REPORTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORTS:
        terminalreporter.write_sep("-", "chaos scenarios")
        terminalreporter.write_line(table(REPORTS))
