"""The chaos scenarios, short: each kills, stops or restarts workers or servers under load for
about ten seconds and checks every run, step execution and key afterwards (scenarios.py,
checks.py). ``CHAOS_SEED`` repeats a scenario's random choices (timing still varies)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.chaos.checks import Report, table
from tests.chaos.scenarios import SCENARIOS, run
from tests.pgserver import PgServer

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name: str, chaos_pg: PgServer, tmp_path: Path, chaos_reports: list[Report]) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(10**6))
    report = run(SCENARIOS[name], chaos_pg, tmp_path, seed)
    report.counts["seed"] = seed
    chaos_reports.append(report)
    print(table([report]))
    print("\n".join(f"problem: {problem}" for problem in report.problems[:40]))
    report.check()
