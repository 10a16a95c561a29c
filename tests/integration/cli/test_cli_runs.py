"""``celery -A app durable runs``: one row per run, its columns aligned whatever the status."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from durable_celery.app import STATUSES
from tests.conftest import REDIS_URL
from tests.integration.helpers import set_run

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]


def test_every_status_keeps_the_columns_aligned(durable, tmp_path):
    wf = durable.workflow("aligned")

    @wf.step
    def only():
        return None

    for status in STATUSES:
        set_run(durable, durable.start(wf, key=f"k-{status}"), status=status)
    (tmp_path / "runsapp.py").write_text(
        textwrap.dedent(f"""
        from celery import Celery
        from durable_celery import Durable
        app = Celery("runsapp", broker={REDIS_URL!r})
        durable = Durable(app, {durable.db.url!r}, upkeep=False)
    """)
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "runsapp", "durable", "runs"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert sorted(row.split()[2] for row in rows) == sorted(STATUSES)
    for column in ("step", "key", "holds", "created"):
        at = header.index(column)
        for row in rows:
            assert row[at - 2 : at] == "  " and row[at] != " " or column == "step", (column, header, row)
    step_end = header.index("step") + len("step")
    assert all(row[step_end - 1].isdigit() and row[step_end] == " " for row in rows), done.stdout
