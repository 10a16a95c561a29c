"""PostgreSQL upkeep in ``durable status`` and ``durable doctor`` (dead rows, vacuum, long
transactions) and ``durable tune-vacuum``, on a real server; and what SQLite says instead."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from durable_celery import Durable
from durable_celery.observe import pg_health
from durable_celery.observe.doctor import Finding

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
TUNED = ("durable_runs", "durable_steps")
RECOMMENDED = (
    "autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.01, "
    "autovacuum_vacuum_cost_limit = 1000"
)


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture
def pg_durable(pg_url: str) -> Iterator[Durable]:
    """A Durable on this test's PostgreSQL database; nothing here needs a broker or upkeep."""
    durable = Durable(Celery("pghealth", broker="memory://"), pg_url, upkeep=False)
    yield durable
    durable.db.dispose()


@pytest.fixture
def sqlite_durable(tmp_path: Path) -> Iterator[Durable]:
    """A Durable on the embedded SQLite default."""
    durable = Durable(Celery("pghealth", broker="memory://"), f"sqlite:///{tmp_path}/durable.sqlite3")
    durable.migrate()
    yield durable
    durable.db.dispose()


def make_cli(url: str, tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``celery -A healthapp durable ...`` against ``url`` in a subprocess."""
    (tmp_path / "healthapp.py").write_text(
        textwrap.dedent(f"""
        from celery import Celery
        from durable_celery import Durable
        app = Celery("healthapp", broker="memory://")
        durable = Durable(app, {url!r}, upkeep=False)
    """)
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "healthapp", "durable", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    return run


def upkeep_findings(durable: Durable) -> list[Finding]:
    return [f for f in durable.doctor() if f.kind in ("dead_tuples", "vacuum_overdue", "long_transaction")]


def poll(fn: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """``fn()`` once it is truthy: statistics reach other sessions a little after a commit."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout}s: {what}")
        time.sleep(0.2)


def make_dead_runs(url: str, inserted: int, deleted: int) -> None:
    """Insert ``inserted`` runs and delete ``deleted`` of them, with autovacuum kept off the
    table so nothing cleans up behind the test; make the statistics visible."""
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        conn.execute("ALTER TABLE durable_runs SET (autovacuum_enabled = false)")
        conn.execute(
            "INSERT INTO durable_runs (id, workflow, status, input, context, created_at) "
            "SELECT 'dead-' || i, 'bulk', 'completed', '{}', '{}', now() "
            "FROM generate_series(1, %s) AS i",
            (inserted,),
        )
        conn.execute(
            "DELETE FROM durable_runs WHERE id IN (SELECT 'dead-' || i FROM generate_series(1, %s) AS i)",
            (deleted,),
        )
        # PostgreSQL 15+ flushes a session's counts at most once a second; ask for it now.
        if conn.info.server_version >= 150000:
            conn.execute("SELECT pg_stat_force_next_flush()")


def test_dead_rows_are_findings_and_status_figures_until_a_vacuum(pg_durable, pg_url, tmp_path):
    assert upkeep_findings(pg_durable) == []
    make_dead_runs(pg_url, 15_000, 12_000)
    found = poll(
        lambda: {f.kind: f for f in upkeep_findings(pg_durable) if f.details.get("table") == "durable_runs"},
        "dead_tuples on durable_runs",
    )
    dead = found["dead_tuples"]
    assert dead.details["dead_rows"] == 12_000 and dead.details["live_rows"] == 3_000
    assert dead.details["dead_ratio"] == 0.8 and not dead.fixable
    assert "durable_runs: 12,000 dead rows, 80% of its rows (over 20%)" in dead.message
    # Off for the table, as set above (and maybe on the whole server, which is said first).
    off_by = dead.details["autovacuum_off_by"]
    assert off_by in ("server", "table") and "autovacuum is off" in dead.message
    overdue = found["vacuum_overdue"]
    assert "never vacuumed" in overdue.message and overdue.details["last_vacuum"] is None

    (runs,) = [t for t in pg_durable.status_summary()["tables"] if t["table"] == "durable_runs"]
    assert (runs["live_rows"], runs["dead_rows"], runs["dead_ratio"]) == (3_000, 12_000, 0.8)
    assert runs["heap_bytes"] > 0 and runs["index_bytes"] > 0
    assert runs["total_bytes"] >= runs["heap_bytes"] + runs["index_bytes"]
    assert runs["autovacuum_on"] is False and runs["autovacuum_off_by"] == off_by
    assert runs["last_vacuum_seconds"] is None

    cli = make_cli(pg_url, tmp_path)
    status = cli("status")
    assert status.returncode == 0, status.stderr
    assert re.search(
        r"^table\s+live rows\s+dead rows\s+dead\s+heap\s+indexes\s+total\s+last vacuum$", status.stdout, re.M
    ), status.stdout
    line = next(x for x in status.stdout.splitlines() if x.startswith("durable_runs "))
    assert re.search(
        r"3,000\s+12,000\s+80\.0%\s+[\d.]+ (kB|MB)\s+[\d.]+ (kB|MB)\s+[\d.]+ (kB|MB)"
        r"\s+never, autovacuum off \((server|table)\)$",
        line,
    ), line
    assert any(x.startswith("durable_steps ") for x in status.stdout.splitlines())
    tables = json.loads(cli("status", "--json").stdout)["tables"]
    assert {"durable_runs", "durable_steps"} <= {t["table"] for t in tables}
    doctor = cli("doctor")
    assert doctor.returncode == 1 and "dead_tuples" in doctor.stdout and "vacuum_overdue" in doctor.stdout

    with psycopg.connect(_libpq(pg_url), autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) durable_runs")
    poll(lambda: upkeep_findings(pg_durable) == [], "no upkeep findings after VACUUM")
    (runs,) = [t for t in pg_durable.status_summary()["tables"] if t["table"] == "durable_runs"]
    assert runs["dead_rows"] == 0 and runs["last_vacuum_by"] == "manual"
    assert runs["last_vacuum_seconds"] < 60


def test_a_transaction_left_idle_is_a_finding_with_its_application_and_age(pg_durable, pg_url, monkeypatch):
    monkeypatch.setattr(pg_health, "LONG_TRANSACTION_AFTER", 1.0)
    assert upkeep_findings(pg_durable) == []
    idle = psycopg.connect(_libpq(pg_url), application_name="nightly-report")
    try:
        idle.execute("SELECT 1")  # psycopg began a transaction; it stays open, idle
        (finding,) = poll(
            lambda: [f for f in upkeep_findings(pg_durable) if f.kind == "long_transaction"],
            "long_transaction",
        )
        details = finding.details
        assert details["pid"] == idle.info.backend_pid
        assert details["application_name"] == "nightly-report"
        assert details["state"] == "idle in transaction"
        assert details["open_seconds"] >= 1.0 and details["state_seconds"] >= 1.0
        assert f"pid {idle.info.backend_pid} (application 'nightly-report', user postgres)" in finding.message
        assert "idle in transaction for" in finding.message
        assert "idle_in_transaction_session_timeout" in finding.message and not finding.fixable
    finally:
        idle.close()
    poll(lambda: upkeep_findings(pg_durable) == [], "no long_transaction once it ended")


def test_a_short_transaction_is_not_a_finding(pg_durable, pg_url):
    with psycopg.connect(_libpq(pg_url), application_name="quick") as conn:
        conn.execute("SELECT 1")
        time.sleep(1.5)
        assert upkeep_findings(pg_durable) == []  # open for 1.5 s, under the minute


def reloptions(url: str) -> dict[str, list[str] | None]:
    with psycopg.connect(_libpq(url)) as conn:
        rows = conn.execute(
            "SELECT relname, reloptions FROM pg_class WHERE relname = ANY(%s)", (list(TUNED),)
        ).fetchall()
    return dict(rows)


def test_tune_vacuum_prints_then_applies(pg_url, tmp_path):
    cli = make_cli(pg_url, tmp_path)
    helped = cli("tune-vacuum", "--help")
    assert helped.returncode == 0 and "--apply" in helped.stdout and "durable_steps" in helped.stdout

    printed = cli("tune-vacuum")
    assert printed.returncode == 0, printed.stderr
    for table in TUNED:
        assert f"-- {table} now: the server defaults" in printed.stdout
        assert f"ALTER TABLE {table} SET ({RECOMMENDED});" in printed.stdout
    assert "nothing changed" in printed.stdout
    assert reloptions(pg_url) == {"durable_runs": None, "durable_steps": None}

    applied = cli("tune-vacuum", "--apply")
    assert applied.returncode == 0, applied.stderr
    expected = [
        "autovacuum_vacuum_scale_factor=0.02",
        "autovacuum_analyze_scale_factor=0.01",
        "autovacuum_vacuum_cost_limit=1000",
    ]
    assert reloptions(pg_url) == {"durable_runs": expected, "durable_steps": expected}
    lines = applied.stdout.splitlines()
    assert lines[0] == f"durable_runs: ALTER TABLE durable_runs SET ({RECOMMENDED})"
    assert lines[1] == f"durable_runs: done, now {', '.join(expected)}"
    assert lines[2].startswith("durable_steps: ALTER TABLE durable_steps")

    again = cli("tune-vacuum")
    assert f"-- durable_runs now: {', '.join(expected)}" in again.stdout


def test_tune_vacuum_gives_up_on_a_table_it_cannot_lock(pg_url, tmp_path):
    cli = make_cli(pg_url, tmp_path)
    with psycopg.connect(_libpq(pg_url), application_name="manual-vacuum-like") as holder:
        holder.execute("LOCK TABLE durable_runs IN SHARE UPDATE EXCLUSIVE MODE")  # as VACUUM holds it
        started = time.monotonic()
        failed = cli("tune-vacuum", "--apply")
        assert time.monotonic() - started < 30
    assert failed.returncode == 1
    assert "durable: durable_runs: ALTER TABLE durable_runs SET (" in failed.stderr
    assert "lock timeout" in failed.stderr and len(failed.stderr.strip().splitlines()) == 1
    assert reloptions(pg_url) == {"durable_runs": None, "durable_steps": None}


def test_sqlite_has_no_postgres_figures_and_says_so(sqlite_durable, tmp_path):
    assert sqlite_durable.status_summary()["tables"] == []
    assert upkeep_findings(sqlite_durable) == []
    cli = make_cli(sqlite_durable.db.url, tmp_path)
    status = cli("status")
    assert status.returncode == 0, status.stderr
    assert "tables: sizes and dead rows are PostgreSQL figures; none on SQLite" in status.stdout
    tuned = cli("tune-vacuum", "--apply")
    assert tuned.returncode == 0, tuned.stderr
    assert "tune-vacuum applies to PostgreSQL only" in tuned.stdout
