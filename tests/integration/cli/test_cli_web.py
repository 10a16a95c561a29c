"""``celery -A app durable web``: a busy port or a URL that cannot work is said in one line
before anything claims to be serving; otherwise it serves."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import _spare_port

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def web(tmp_path):
    """Start ``celery -A webapp durable web ...`` with the app's Durable on ``url``."""
    (tmp_path / "webapp.py").write_text(
        textwrap.dedent("""
        import os
        from celery import Celery
        from durable_celery import Durable
        app = Celery("webapp", broker="memory://")
        durable = Durable(app, os.environ["WEBAPP_URL"], upkeep=False)
    """)
    )
    started: list[subprocess.Popen[str]] = []

    def start(url: str, *args: str) -> subprocess.Popen[str]:
        env = {**os.environ, "WEBAPP_URL": url, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
        env.pop("CELERY_APP", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "webapp", "durable", "web", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.communicate()


def test_a_busy_port_is_refused_before_it_claims_to_serve(web, tmp_path):
    port = _spare_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        out, err = web(f"sqlite:///{tmp_path}/d.sqlite3", "--port", str(port)).communicate(timeout=60)
    assert "dashboard on" not in out
    assert err.strip().splitlines() == [
        f"durable: cannot serve the dashboard on 127.0.0.1:{port}: Address already in use; "
        "is another process using it? choose another with --port"
    ]


def test_a_url_that_cannot_work_is_refused_before_it_claims_to_serve(web):
    proc = web("mysql://shop:secret@127.0.0.1/shop", "--port", str(_spare_port()))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "dashboard on" not in out
    assert err.startswith("durable: durable keeps its runs in PostgreSQL or SQLite, not mysql")
    assert "secret" not in err


def test_it_serves_on_the_port_it_names(web, tmp_path):
    port = _spare_port()
    proc = web(f"sqlite:///{tmp_path}/d.sqlite3", "--port", str(port))
    assert proc.stdout is not None
    assert (
        proc.stdout.readline().strip()
        == f"durable dashboard on http://127.0.0.1:{port}/ (read-only (no token))"
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/settings", timeout=5) as page:
                assert page.status == 200
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
