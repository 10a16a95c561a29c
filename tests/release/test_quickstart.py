"""Guards issue 39: a new user's first hour, literally. The wheel is built and installed without
extras into a fresh venv outside the checkout; then README.md's Quickstart (its ``app.py``,
``durable migrate``, a real ``celery -A app worker``, its start calls) runs on PostgreSQL with
Redis, and with RabbitMQ in place of Redis, until both runs complete; and docs/django.md's "A
new project, step by step" runs on a new ``django-admin startproject`` after ``pip install`` of
the wheel with ``[django]``.

The code and commands are read from the two documents, not copied here: only the database
name and the Redis address are swapped (each replaced text must be there as the test expects),
so the test fails when the documents stop matching what runs. The database is one of the
test's own and the broker the session's private ``redis-server``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PG_HOST, REDIS_URL, _admin

ROOT = Path(__file__).resolve().parents[2]
README_DB = "postgresql://postgres@127.0.0.1:5432/app"
README_BROKER = "redis://127.0.0.1:6379/0"

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


def blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced code block of a Markdown text: (language, code)."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)]


def section(text: str, heading: str) -> str:
    """The text of a Markdown section, from its heading to the next of the same level."""
    start = text.index(heading)
    level = heading.split(" ", 1)[0]
    following = re.search(rf"^{level} ", text[start + len(heading) :], re.M)
    return text[start : start + len(heading) + following.start()] if following else text[start:]


def swap(code: str, old: str, new: str) -> str:
    """``code`` with ``old`` replaced; fails when ``old`` is not there (the docs changed)."""
    assert old in code, f"the documented code no longer has {old!r}:\n{code}"
    return code.replace(old, new)


def commands(code: str) -> list[str]:
    """The commands of a shell block, each without its trailing comment."""
    found = []
    for line in code.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            found.append(line)
    return found


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv (no system packages) with the wheel built from this checkout, no extras."""
    where = tmp_path_factory.mktemp("quickstart")
    dist = where / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("durable_celery-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(where / "venv")], check=True, timeout=120)
    pip = [str(where / "venv" / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    done = subprocess.run([*pip, str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (where / "venv" / "wheel").write_text(str(wheel))
    yield where / "venv"


class Shell:
    """Runs commands as a new user would: in ``cwd``, with the venv's bin first on PATH and
    nothing of this checkout or this test's environment."""

    def __init__(self, venv: Path, cwd: Path) -> None:
        self.cwd = cwd
        self.env = {
            "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
            "HOME": str(cwd),
            "PYTHONUNBUFFERED": "1",
            "PGGSSENCMODE": "disable",
        }
        self.background: list[subprocess.Popen[str]] = []

    def run(self, command: str, timeout: float = 180, **env: str) -> str:
        """Run one command; its output (fails the test when it fails)."""
        done = subprocess.run(
            command,
            shell=True,
            cwd=self.cwd,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"`{command}` failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    def start(self, command: str, log: Path) -> subprocess.Popen[str]:
        """Start a long-running command (a worker) in the background, its output to ``log``."""
        process = subprocess.Popen(
            command,
            shell=True,
            cwd=self.cwd,
            env=self.env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.background.append(process)
        return process

    def stop(self) -> None:
        """Stop what runs in the background: SIGTERM, then SIGKILL after 30 s."""
        for process in self.background:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.background:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


@pytest.fixture
def database() -> Iterator[str]:
    """The name of an empty database of this test's own (what ``createdb`` makes)."""
    name = f"durable_t_qs_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        with _admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


# Appended to the documented start calls: wait for the runs they started, print how they ended.
WAIT = """
import json as _json
from durable_celery.testing import wait_for as _wait_for

_ended = [_wait_for({durable}, _id, timeout=120) for _id in {ids}]
print("RESULT " + _json.dumps([[r.status, r.output] for r in _ended]))
"""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_the_readme_quickstart_runs_from_the_wheel_on_postgresql(
    venv: Path, tmp_path: Path, database: str, broker: str, request: pytest.FixtureRequest
) -> None:
    readme = section((ROOT / "README.md").read_text(), "## Quickstart")
    python_blocks = [code for lang, code in blocks(readme) if lang == "python"]
    shell_blocks = [code for lang, code in blocks(readme) if lang == "sh"]
    app_py, starts = python_blocks[0], next(code for code in python_blocks if "from app import" in code)
    url = f"{PG_HOST}/{database}"
    broker_url = REDIS_URL if broker == "redis" else request.getfixturevalue("rabbitmq")
    if broker == "redis":
        request.getfixturevalue("redis_client")  # the session's private redis-server is up
    app_py = swap(swap(app_py, README_DB, url), README_BROKER, broker_url)
    home = tmp_path / "user"
    home.mkdir()
    (home / "app.py").write_text(app_py)
    shell = Shell(venv, home)
    # `pip install durable-celery` installed nothing more: the transports import what they need.
    shell.run("python -c 'import kombu.transport.redis, kombu.transport.pyamqp, durable_celery'")
    try:
        for command in commands(shell_blocks[0]):
            if command.startswith("createdb"):  # the test made an empty database of its own
                continue
            if " worker" in command:
                worker = shell.start(command, tmp_path / "worker.log")
            else:
                shell.run(command)
        code = starts + WAIT.format(durable="durable", ids="[run_id, article_run]")
        (home / "starts.py").write_text(code)
        out = shell.run("python starts.py", timeout=240)
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
    finally:
        shell.stop()
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result == [
        ["completed", {"account": 7, "saved": 2}],
        ["completed", "article 42 processed"],
    ], (tmp_path / "worker.log").read_text()[-4000:]


@pytest.mark.timeout(900)
def test_a_new_django_project_follows_the_django_guide_to_a_completed_run(
    venv: Path, tmp_path: Path, database: str, redis_server: str
) -> None:
    guide = section((ROOT / "docs" / "django.md").read_text(), "## A new project, step by step")
    found = blocks(guide)
    shell = Shell(venv, tmp_path)
    wheel = (venv / "wheel").read_text()
    where = {"NAME": database, **_pg_parts()}
    try:
        for lang, code in found:
            if lang == "sh":
                _run_commands(shell, code, wheel, tmp_path)
                continue
            first = code.splitlines()[0]
            if first.startswith("# python manage.py shell"):
                out = shell.run(_shell_command(code), timeout=240)
                continue
            path = shell.cwd / first.removeprefix("# ").split(":", 1)[0].strip()
            if "/settings.py" in str(path):
                code = swap(code, '"NAME": "shop"', f'"NAME": "{where["NAME"]}"')
                code = swap(
                    code, '"HOST": "127.0.0.1"', f'"HOST": "{where["HOST"]}", "PORT": "{where["PORT"]}"'
                )
                code = swap(code, README_BROKER, REDIS_URL)
                path.write_text(path.read_text() + "\n" + code)  # "add at the end"
            else:
                path.write_text(code)
            if first == "# proj/__init__.py":
                shell.cwd = path.parent.parent  # `cd proj` came before: manage.py is here
    finally:
        shell.stop()
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result == [["completed", {"order": 1, "item": "mug"}]], (tmp_path / "worker.log").read_text()[
        -4000:
    ]
    assert "System check identified no issues" in shell.run("python manage.py check")
    # The workflows in shop/workflows.py are known to the commands without an import by hand:
    # the finished holder blocks a new start only by its workflow's reuse="after_failure".
    runs = shell.run("celery -A proj durable runs -w fulfil")
    assert "completed" in runs and re.search(r"\byes\b", runs), runs
    keys = shell.run("celery -A proj durable keys --json")
    (entry,) = [json.loads(line) for line in keys.splitlines() if line.startswith("{")]
    assert entry["key"] == "order:1" and entry["blocks"] is True, keys


def _pg_parts() -> dict[str, Any]:
    from urllib.parse import urlsplit

    parts = urlsplit(PG_HOST)
    return {"HOST": parts.hostname or "127.0.0.1", "PORT": str(parts.port or 5432)}


def _run_commands(shell: Shell, code: str, wheel: str, tmp_path: Path) -> None:
    """A shell block of the guide: ``pip install`` takes the wheel built here, ``createdb`` is
    the test's database, ``cd`` moves the shell, and the worker runs in the background."""
    for command in commands(code):
        if command.startswith("pip install"):
            shell.run(f"python -m pip install --quiet '{wheel}[django]'", timeout=600)
        elif command.startswith("createdb"):
            continue
        elif command.startswith("cd "):
            shell.cwd = shell.cwd / command[3:].strip()
        elif " worker" in command:
            shell.start(command, tmp_path / "worker.log")
        else:
            if command == "python manage.py migrate":
                _worker_refuses_an_unmigrated_database(shell)
            shell.run(command)


def _worker_refuses_an_unmigrated_database(shell: Shell) -> None:
    """Before ``migrate``: a worker stops at once, saying once (not once per log handler) to
    run manage.py migrate."""
    done = subprocess.run(
        "celery -A proj worker -l info",
        shell=True,
        cwd=shell.cwd,
        env=shell.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert said.count("the database schema is behind this code") == 1, said
    assert "run `python manage.py migrate`, then start this worker again" in said, said


def _shell_command(code: str) -> str:
    """``python manage.py shell -c`` running the guide's block, then waiting for its run."""
    script = code + WAIT.format(durable="__import__('proj.celery').celery.durable", ids="[run_id]")
    return "python manage.py shell -c " + _quote(script)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"
