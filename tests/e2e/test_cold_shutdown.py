"""A cold shutdown (SIGQUIT, or a second Ctrl-C) of a real worker in the middle of a step: the
worker hands the run back as it goes, so the next worker runs the step at once, not after the
stale timeout (300 s here). PostgreSQL and Redis; fails (never skips) without them."""

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
from typing import Any

import pytest
from celery import Celery

from durable_celery import Durable
from durable_celery.testing import wait_for
from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parents[2]

APP = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from celery import Celery
    from durable_celery import Durable, signals

    app = Celery("coldapp", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    app.conf.worker_prefetch_multiplier = 1
    durable = Durable(
        app,
        os.environ["DB"],
        poll_interval=0.2,
        heartbeat_interval=0.4,
        stale_lock_timeout=300.0,  # far longer than the test: no recovery by the sweep
        relay_after=300.0,
        shutdown_grace_period=float(os.environ.get("GRACE", "60")),
    )
    marks = Path(os.environ["MARKS"])

    if os.environ.get("SLOW_DRAIN"):  # a receiver that keeps the worker in durable's stop step a while

        @signals.worker_draining.connect
        def slow(**_):
            (marks / "draining").touch()
            time.sleep(3.0)

    job = durable.workflow("job")

    @job.step
    def work():
        # The first worker's step runs until its worker goes; the next worker's finishes.
        first = not (marks / "started").exists()
        (marks / "started").touch()
        while first:
            time.sleep(0.05)
        return os.environ["NAME"]
    """
)


@pytest.fixture
def env(pg_url: str, tmp_path: Path, redis_client: Any) -> dict[str, str]:
    (tmp_path / "coldapp.py").write_text(APP)
    (tmp_path / "marks").mkdir()
    base = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    return {
        **base,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
        "BROKER": REDIS_URL,
        "QUEUE": f"cold-{uuid.uuid4().hex[:8]}",
        "DB": pg_url,
        "MARKS": str(tmp_path / "marks"),
    }


@pytest.fixture
def start_worker(env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, pool: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, "-m", "celery", "-A", "coldapp", "worker", "-P", pool, "-c", "1"]
        cmd += ["-n", f"{name}@%h", "-Q", env["QUEUE"], "-l", "info", "--without-mingle", "--without-gossip"]
        proc = subprocess.Popen(cmd, cwd=tmp_path, env={**env, "NAME": name}, stdout=log, stderr=log)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def client(env: dict[str, str]) -> Iterator[Durable]:
    """A producer-side Durable on the same database and queue (no worker of its own)."""
    app = Celery("coldapp", broker=env["BROKER"])
    app.conf.task_default_queue = env["QUEUE"]
    durable = Durable(app, env["DB"], upkeep=False)
    durable.workflow("job").step(lambda: None, name="work")
    yield durable
    durable.db.dispose()


def wait_path(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear within {seconds}s"
        time.sleep(0.02)


def wait_said(log: Path, text: str, seconds: float) -> None:
    """Wait until the worker's log shows ``text`` (a handler it installs at start is in place)."""
    deadline = time.monotonic() + seconds
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{log.name} did not say {text!r} within {seconds}s"
        time.sleep(0.05)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("pool", "signals"),
    [
        ("prefork", [signal.SIGQUIT]),
        ("prefork", [signal.SIGINT, signal.SIGINT]),  # Ctrl-C twice: warm, then cold
        ("threads", [signal.SIGQUIT]),
        ("threads", [signal.SIGINT, signal.SIGINT]),
    ],
    ids=["prefork-SIGQUIT", "prefork-second-ctrl-c", "threads-SIGQUIT", "threads-second-ctrl-c"],
)
def test_a_cold_shutdown_hands_the_step_back_and_the_next_worker_runs_it_at_once(
    client: Durable,
    start_worker: Callable[..., subprocess.Popen[bytes]],
    env: dict[str, str],
    tmp_path: Path,
    pool: str,
    signals: list[signal.Signals],
) -> None:
    first = start_worker("first", pool)
    run_id = client.start("job")
    wait_path(Path(env["MARKS"]) / "started", 30)
    stopped_at = time.monotonic()
    for n, sig in enumerate(signals):
        if n:  # the warm shutdown has begun (its grace period is 60 s): now the second Ctrl-C
            wait_said(tmp_path / "first.log", "draining", 20)
        first.send_signal(sig)
    first.wait(30)
    gone = time.monotonic() - stopped_at
    (handed,) = client.activity(kinds=["handed_back"], run_id=run_id)
    assert handed.details["step"] == "work"
    second = start_worker("second", pool)
    run = wait_for(client, run_id, timeout=60)
    took = time.monotonic() - stopped_at
    how = "+".join(s.name for s in signals)
    print(f"\n{pool} {how}: worker gone in {gone:.2f}s, run completed {took:.2f}s after the signal")
    assert run.status == "completed" and run.output == "second" and second.poll() is None
    assert took < 60  # well under the 300 s stale timeout: the next worker took it at once
    assert [(s.attempt, s.status) for s in client.list_steps(run_id)] == [(1, "completed")]  # no attempt used


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_while_the_worker_is_in_its_own_stop_step_still_hands_the_step_back(
    client: Durable,
    start_worker: Callable[..., subprocess.Popen[bytes]],
    env: dict[str, str],
) -> None:
    # Celery's cold-shutdown handler runs wherever the main thread is; here that is durable's
    # stop step (a worker_draining receiver), not the threads pool's wait, so the handler's
    # cancel never reaches the pool. The grace period (60 s) must end all the same.
    env["SLOW_DRAIN"] = "1"
    first = start_worker("first", "threads")
    run_id = client.start("job")
    marks = Path(env["MARKS"])
    wait_path(marks / "started", 30)
    first.send_signal(signal.SIGINT)
    wait_path(marks / "draining", 20)
    first.send_signal(signal.SIGINT)
    first.wait(30)  # well within the 60 s grace period
    (handed,) = client.activity(kinds=["handed_back"], run_id=run_id)
    assert handed.details["step"] == "work"
    start_worker("second", "threads")
    run = wait_for(client, run_id, timeout=60)
    assert run.status == "completed" and run.output == "second"
