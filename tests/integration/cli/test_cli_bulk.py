"""``celery -A app durable bulk``: the filters of the incident runbook, a dry run that changes
nothing, a confirmation unless ``--yes``, progress, and the counts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from durable_celery.store.schema import runs
from tests.conftest import REDIS_URL

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(params=["postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _cli(
    durable: Any, tmp_path: Path, *args: str, answer: str | None = None
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "bulkapp.py").write_text(
        textwrap.dedent(f"""
        from celery import Celery
        from durable_celery import Durable
        app = Celery("bulkapp", broker={REDIS_URL!r})
        durable = Durable(app, {durable.db.url!r}, upkeep=False)
        charge = durable.workflow("charge")
        charge.step(lambda order: order, name="pay")
    """)
    )
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "bulkapp", "durable", "bulk", *args],
        capture_output=True,
        text=True,
        input=answer,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
        timeout=60,
    )


def test_bulk_retry_by_tag_and_window_with_a_dry_run_a_prompt_and_yes(durable: Any, tmp_path: Path) -> None:
    wf = durable.workflow("charge")

    @wf.step
    def pay(order: int) -> int:
        raise ConnectionError("provider down")

    at = durable.db.utcnow().replace(hour=14, minute=2, second=0, microsecond=0) - timedelta(days=1)
    ids = []
    for n in range(6):
        run_id = durable.start(wf, {"order": n}, tags={"tenant": "acme" if n < 4 else "globex"})
        assert durable.run_message("charge", 0, run_id) == "failed"
        with durable.db.begin() as conn:
            conn.execute(
                update(runs).where(runs.c.id == run_id).values(created_at=at + timedelta(minutes=3 * n))
            )
        ids.append(run_id)
    since = at.strftime("%Y-%m-%dT%H:%M")
    flags = ["-w", "charge", "-s", "failed", "--since", since, "--until", "14:12", "-t", "tenant=acme"]
    dry = _cli(durable, tmp_path, "retry", *flags, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "4 matched, would act on 4" in dry.stdout  # 14:02, :05, :08, :11 of acme
    assert {durable.get_run(r).status for r in ids} == {"failed"}
    refused = _cli(durable, tmp_path, "retry", *flags, answer="n\n")
    assert refused.returncode == 1 and "retry 4 run(s)?" in refused.stdout and "Aborted" in refused.stderr
    assert {durable.get_run(r).status for r in ids} == {"failed"}
    done = _cli(durable, tmp_path, "retry", *flags, "--yes")
    assert done.returncode == 0, done.stderr
    assert "4 of 4 runs looked at" in done.stdout and "did act on 4" in done.stdout
    assert [durable.get_run(r).status for r in ids] == ["running"] * 4 + ["failed"] * 2  # retried at its step
    bad = _cli(durable, tmp_path, "retry", "-t", "tenant")
    assert bad.returncode == 2 and "a tag is name=value" in bad.stderr
