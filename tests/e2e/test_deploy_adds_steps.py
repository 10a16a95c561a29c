"""A deploy that adds steps: a run started on an older definition goes on into steps a deploy
added after its current step.

A run of ``deploy_flow`` starts on the old build (steps ``first``, ``second``) under a real
``celery worker``; while it is in ``second`` the worker is stopped gracefully (SIGTERM), and a
worker of the new build (``first``, ``second``, ``added``: same module name, Celery app and
workflow) takes over. The run finishes ``second`` on the new build and goes on into ``added``.
Two ways of being in the middle of ``second`` when the old worker stops:

- ``handed-back``: the step is running (it waits for a file the test creates only after the old
  worker is gone); the shutdown grace period (1 s) ends and the worker hands the run back;
- ``waiting``: the step waits for an event (``current_run().wait_for_event``), so the run is
  parked as ``waiting``; the test sends the event once the new worker runs.

docs/production.md, "Rolling out new code": "New steps added after the step a run is at are
picked up as it goes on." PostgreSQL and Redis; fails (never skips) without them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from celery import Celery

from durable_celery import Durable
from durable_celery.testing import wait_for
from tests.conftest import REDIS_URL
from tests.e2e.support import until

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = "deploy_flow"

# The old build's module; @BUILD@ becomes "old" or "new" (each step returns the build that ran it).
OLD_BUILD = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from celery import Celery
    from durable_celery import Durable, current_run

    BUILD = "@BUILD@"

    app = Celery("deployapp", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    app.conf.worker_prefetch_multiplier = 1
    durable = Durable(
        app,
        os.environ["DB"],
        poll_interval=0.2,
        heartbeat_interval=0.4,
        stale_lock_timeout=300.0,  # far longer than the test: no recovery by the sweep
        relay_after=300.0,  # nor by a guessed re-send
        shutdown_grace_period=1.0,
    )
    marks = Path(os.environ["MARKS"])
    flow = durable.workflow("deploy_flow")


    @flow.step
    def first(order, **_):
        current_run().context["first_build"] = BUILD
        return {"step": "first", "build": BUILD}


    @flow.step
    def second(order, block, **_):
        (marks / f"second-{BUILD}").touch()
        if block == "event":
            got = current_run().wait_for_event("go")
        else:  # runs until the test creates the file, which it does once the old worker is gone
            while not (marks / "release").exists():
                time.sleep(0.05)
            got = "released"
        return {"step": "second", "build": BUILD, "got": got}
    """
)

# The new build: the same module with a step declared after ``second``.
NEW_BUILD = OLD_BUILD + textwrap.dedent(
    """

    @flow.step
    def added(order, **_):
        return {"step": "added", "build": BUILD, "order": order, "context": dict(current_run().context)}
    """
)


@pytest.fixture
def env(pg_url: str, tmp_path: Path, redis_client: Any) -> dict[str, str]:
    """The workers' environment; ``tmp_path/old`` and ``tmp_path/new`` each hold a
    ``deployapp.py``, one of them on a worker's PYTHONPATH."""
    for build, source in (("old", OLD_BUILD), ("new", NEW_BUILD)):
        (tmp_path / build).mkdir()
        (tmp_path / build / "deployapp.py").write_text(source.replace("@BUILD@", build))
    (tmp_path / "marks").mkdir()
    base = {name: os.environ[name] for name in ("PATH", "HOME", "PGGSSENCMODE") if name in os.environ}
    return {
        **base,
        "PYTHONUNBUFFERED": "1",
        "BROKER": REDIS_URL,
        "QUEUE": f"deploy-{uuid.uuid4().hex[:8]}",
        "DB": pg_url,
        "MARKS": str(tmp_path / "marks"),
    }


@pytest.fixture
def start_worker(env: dict[str, str], tmp_path: Path) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    """Start ``celery -A deployapp worker`` of a build (``old`` or ``new``), named ``<build>@%h``,
    on the test's queue; every worker started is killed at the end if it still runs."""
    started: list[tuple[subprocess.Popen[bytes], IO[str]]] = []

    def start(build: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{build}.log", "w")  # noqa: SIM115 - closed at the end
        cmd = [sys.executable, "-m", "celery", "-A", "deployapp", "worker", "-P", "prefork", "-c", "1"]
        cmd += ["-n", f"{build}@%h", "-Q", env["QUEUE"], "-l", "info", "--without-mingle", "--without-gossip"]
        path = f"{tmp_path / build}{os.pathsep}{ROOT}"
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env={**env, "PYTHONPATH": path}, stdout=log, stderr=subprocess.STDOUT
        )
        started.append((proc, log))
        return proc

    try:
        yield start
    finally:
        for proc, log in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()


@pytest.fixture
def client(env: dict[str, str]) -> Iterator[Durable]:
    """A producer on the same database and queue, with the old definition (no worker of its own)."""
    app = Celery("deployapp", broker=env["BROKER"])
    app.conf.task_default_queue = env["QUEUE"]
    durable = Durable(app, env["DB"], upkeep=False)
    flow = durable.workflow(WORKFLOW)
    flow.step(lambda order, **_: None, name="first")
    flow.step(lambda order, block, **_: None, name="second")
    yield durable
    durable.db.dispose()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", ["handed-back", "event"], ids=["handed-back", "waiting"])
def test_a_run_started_on_the_old_definition_goes_on_into_a_step_the_deploy_added(
    client: Durable,
    start_worker: Callable[[str], subprocess.Popen[bytes]],
    env: dict[str, str],
    tmp_path: Path,
    block: str,
) -> None:
    marks = Path(env["MARKS"])

    def logs() -> str:
        found = sorted(tmp_path.glob("*.log"))
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}" for log in found)

    began = time.monotonic()
    old = start_worker("old")
    run_id = client.start(WORKFLOW, {"order": 7, "block": block})
    until(lambda: (marks / "second-old").exists(), 60, "the old build to reach step second", logs)
    if block == "event":  # parked in second, waiting for its event
        until(lambda: client.get_run(run_id).status == "waiting", 30, "the run to wait", logs)

    # The deploy: the old worker stops gracefully, then a worker of the new build starts.
    stopped_at = time.monotonic()
    old.send_signal(signal.SIGTERM)
    try:
        assert old.wait(30) == 0, logs()
    except subprocess.TimeoutExpired:
        pytest.fail(f"the old worker did not stop within 30 s of SIGTERM\n{logs()}")
    run = client.get_run(run_id)
    assert run.status in ("running", "waiting") and run.step_index == 1, (run, logs())
    if block == "handed-back":
        handed = client.activity(kinds=["handed_back"], run_id=run_id)
        assert [entry.details["step"] for entry in handed] == ["second"], logs()
        (marks / "release").touch()
    assert not (marks / "second-new").exists()
    new = start_worker("new")
    if block == "event":
        assert client.send_event(run_id, "go", "went"), logs()

    try:
        run = wait_for(client, run_id, timeout=60)
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{logs()}")
    took = time.monotonic() - stopped_at
    print(
        f"\n{block}: run completed {took:.2f}s after SIGTERM to the old worker, "
        f"{time.monotonic() - began:.2f}s in all"
    )

    assert run.status == "completed", (run, logs())
    assert new.poll() is None, logs()
    got = "went" if block == "event" else "released"
    steps = client.list_steps(run_id)
    assert [(s.name, s.attempt, s.status) for s in steps] == [
        ("first", 1, "completed"),
        ("second", 1, "completed"),  # the hand-back or the wait used no attempt
        ("added", 1, "completed"),
    ], logs()
    assert [s.output for s in steps] == [
        {"step": "first", "build": "old"},
        {"step": "second", "build": "new", "got": got},
        {"step": "added", "build": "new", "order": 7, "context": {"first_build": "old"}},
    ]
    assert run.output == {"step": "added", "build": "new", "order": 7, "context": {"first_build": "old"}}
    assert not client.activity(kinds=["code_missing", "definition_changed"], run_id=run_id)
