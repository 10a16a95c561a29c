"""A worker given a database URL that cannot work (a database or user that does not exist)
refuses to start in one line with the fix, exit code 1, instead of starting and logging a
traceback at every pass; an outage (a server that does not answer) still lets it start and wait."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.conftest import PG_HOST, REDIS_URL

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _worker(tmp_path: Path, url: str, seconds: float = 60) -> subprocess.CompletedProcess[str]:
    (tmp_path / "confapp.py").write_text(
        textwrap.dedent(f"""
        import os
        from celery import Celery
        from durable_celery import Durable
        app = Celery("confapp", broker={REDIS_URL!r})
        app.conf.task_default_queue = "confapp-{uuid.uuid4().hex[:8]}"
        durable = Durable(app, os.environ["CONF_URL"])
    """)
    )
    env = {**os.environ, "CONF_URL": url, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "confapp",
            "worker",
            "-P",
            "threads",
            "-c",
            "1",
            "-l",
            "warning",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=seconds,
    )


def test_a_worker_on_a_database_that_does_not_exist_refuses_to_start(tmp_path):
    name = f"no_such_db_{uuid.uuid4().hex[:8]}"
    done = _worker(tmp_path, f"{PG_HOST}/{name}")
    assert done.returncode == 1, done.stderr
    # One message (logged, and printed for a terminal without logging), said before it stops.
    said = {line.split("] ", 1)[-1] for line in done.stderr.splitlines() if "durable: " in line}
    assert len(said) == 1, done.stderr
    (message,) = said
    assert (
        message.startswith("durable: database unavailable at ")
        and f'database "{name}" does not exist' in message
    )
    assert message.endswith("fix: create that database (createdb NAME) or fix the database name in the URL")
    assert "Traceback" not in done.stderr


def test_a_worker_with_a_user_that_does_not_exist_refuses_to_start(tmp_path):
    user = f"nobody_{uuid.uuid4().hex[:6]}"
    host = PG_HOST.split("@", 1)[1]
    done = _worker(tmp_path, f"postgresql://{user}@{host}/postgres")
    assert done.returncode == 1, done.stderr
    assert (
        f'role "{user}" does not exist' in done.stderr and "fix: check the user and password" in done.stderr
    )
    assert "Traceback" not in done.stderr


def test_a_worker_whose_database_is_down_starts_and_waits(tmp_path):
    """An outage is not a configuration error: the worker keeps running (stopped by the timeout)."""
    with pytest.raises(subprocess.TimeoutExpired) as still_running:
        _worker(tmp_path, "postgresql://postgres@127.0.0.1:1/app", seconds=8)
    assert b"could not check the database schema at start" in (still_running.value.stderr or b"")
