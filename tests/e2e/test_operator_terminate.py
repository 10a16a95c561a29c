"""What an operator's Celery tools do to a step, seen by the run: ``celery control terminate``
and ``revoke(terminate=True)`` of a running step (prefork: an attempt that ended, recorded
``Terminated``; threads: Celery cannot terminate, the step runs on), a plain ``revoke`` of a
step message that has not started (the run is sent again at once), and the same story told by
Flower, the worker's metrics and the dashboard. Real workers on PostgreSQL and Redis."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from starlette.testclient import TestClient

from durable_celery import Durable
from durable_celery.testing import wait_for
from durable_celery.web import create_app
from tests.conftest import REDIS_URL
from tests.e2e.support import free_port, http_json, until

ROOT = Path(__file__).resolve().parents[2]

APP = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from celery import Celery, current_task
    from durable_celery import Durable, current_run

    app = Celery("termapp", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    app.conf.worker_prefetch_multiplier = 1
    port = os.environ.get("METRICS_PORT")
    durable = Durable(
        app,
        os.environ["DB"],
        poll_interval=0.2,
        heartbeat_interval=0.4,
        stale_lock_timeout=300.0,  # far longer than any test here: no recovery by the sweep
        relay_after=300.0,  # nor by the relay's re-send of a lost message
        backoff_base=0.5,
        metrics_port=int(port) if port else None,
    )
    marks = Path(os.environ["MARKS"])

    hold = durable.workflow("hold")

    @hold.step(retry=int(os.environ.get("RETRY", "2")))
    def wait_here(tag):
        # Each attempt leaves its task id, then runs until the test lets its tag go.
        (marks / f"{tag}-pid-{current_run().attempt}").write_text(str(os.getpid()))
        (marks / f"{tag}-task-{current_run().attempt}").write_text(current_task.request.id)
        while not (marks / f"{tag}-go").exists():
            time.sleep(0.05)
        return current_run().attempt

    ping = durable.workflow("ping")
    ping.step(lambda: "pong", name="pong")
    """
)


@pytest.fixture
def env(pg_url: str, tmp_path: Path, redis_client: Any) -> dict[str, str]:
    (tmp_path / "termapp.py").write_text(APP)
    (tmp_path / "marks").mkdir()
    base = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    return {
        **base,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
        "BROKER": REDIS_URL,
        "QUEUE": f"term-{uuid.uuid4().hex[:8]}",
        "DB": pg_url,
        "MARKS": str(tmp_path / "marks"),
        "FLOWER_UNAUTHENTICATED_API": "true",
    }


@pytest.fixture
def start(env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start a ``celery`` process of the test app (a worker, Flower), stopped at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def run(name: str, *args: str, **extra: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, "-m", "celery", "-A", "termapp", *args]
        proc = subprocess.Popen(cmd, cwd=tmp_path, env={**env, **extra}, stdout=log, stderr=log)
        started.append(proc)
        return proc

    yield run
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def start_worker(start: Callable[..., Any], env: dict[str, str], pool: str, **extra: str) -> Any:
    args = ["worker", "-E", "-P", pool, "-c", "1", "-Q", env["QUEUE"], "-n", f"{env['QUEUE']}@%h"]
    return start("worker", *args, "--without-mingle", "--without-gossip", "-l", "info", **extra)


@pytest.fixture
def client(env: dict[str, str]) -> Iterator[Durable]:
    """A producer-side Durable on the same database and queue (no worker of its own)."""
    app = Celery("termapp", broker=env["BROKER"])
    app.conf.task_default_queue = env["QUEUE"]
    durable = Durable(app, env["DB"], upkeep=False)
    durable.workflow("hold").step(lambda tag: None, name="wait_here")
    durable.workflow("ping").step(lambda: None, name="pong")
    yield durable
    durable.db.dispose()


def wait_file(path: Path, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path.name} did not appear within {seconds}s"
        time.sleep(0.02)
    return path.read_text()


def node(env: dict[str, str]) -> str:
    """The test worker's node name."""
    return f"{env['QUEUE']}@{socket.gethostname()}"


def control(env: dict[str, str], tmp_path: Path, *args: str) -> str:
    """Run ``celery -A termapp control ...`` as an operator would, to the test's worker (it
    returns on the worker's answer); returns its output."""
    cmd = [sys.executable, "-m", "celery", "-A", "termapp", "control", *args, "-d", node(env), "-t", "10"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["control terminate SIGKILL", "revoke(terminate=True)"])
def test_a_terminated_prefork_step_is_an_attempt_that_ended_and_the_next_one_runs(
    client: Durable, start: Any, env: dict[str, str], tmp_path: Path, how: str
) -> None:
    start_worker(start, env, "prefork", RETRY="2")
    marks = Path(env["MARKS"])
    run_id = client.start("hold", {"tag": "a"})
    task_id = wait_file(marks / "a-task-1", 30)
    if how.startswith("control"):
        assert f"terminate: {task_id}" in control(env, tmp_path, "terminate", "SIGKILL", task_id)
        signal_name = "SIGKILL"
    else:
        # Celery's default signal: SIGTERM
        client.app.control.revoke(task_id, terminate=True, destination=[node(env)], reply=True, timeout=10)
        signal_name = "SIGTERM"
    sent_at = time.monotonic()
    wait_file(marks / "a-task-2", 15)  # the next attempt runs, not after the 300 s stale timeout
    took = time.monotonic() - sent_at
    print(f"\n{how}: attempt 2 running {took:.2f}s after the command")
    assert took < 10
    first = client.list_steps(run_id)[0]
    assert (first.attempt, first.status, first.error["type"]) == (1, "failed", "Terminated")
    assert f"terminated by a control command ({signal_name})" in first.error["message"]
    (marks / "a-go").touch()
    run = wait_for(client, run_id, timeout=30)
    assert run.status == "completed" and run.output == 2


@pytest.mark.timeout(120)
def test_a_terminated_prefork_step_with_no_attempt_left_fails_the_run_within_seconds(
    client: Durable, start: Any, env: dict[str, str], tmp_path: Path
) -> None:
    start_worker(start, env, "prefork", RETRY="1")
    run_id = client.start("hold", {"tag": "b"})
    task_id = wait_file(Path(env["MARKS"]) / "b-task-1", 30)
    assert f"terminate: {task_id}" in control(env, tmp_path, "terminate", "SIGTERM", task_id)
    sent_at = time.monotonic()
    run = wait_for(client, run_id, timeout=15)
    print(f"\nterminate, retry=1: run failed {time.monotonic() - sent_at:.2f}s after the command")
    assert run.status == "failed" and run.error["type"] == "Terminated"
    assert "terminated by a control command (SIGTERM)" in run.error["message"]
    assert [(s.attempt, s.status) for s in client.list_steps(run_id)] == [(1, "failed")]


@pytest.mark.timeout(120)
def test_the_threads_pool_cannot_terminate_a_step_so_it_runs_on_and_is_recorded_as_usual(
    client: Durable, start: Any, env: dict[str, str], tmp_path: Path
) -> None:
    start_worker(start, env, "threads", RETRY="2")
    marks = Path(env["MARKS"])
    run_id = client.start("hold", {"tag": "c"})
    task_id = wait_file(marks / "c-task-1", 30)
    answer = control(env, tmp_path, "terminate", "SIGKILL", task_id)
    assert "does not implement kill_job" in answer  # Celery says so to the operator
    beat = heartbeat_at(client, run_id)
    until(lambda: heartbeat_at(client, run_id) != beat, 10, "the step heart-beating on")
    run = client.get_run(run_id)
    assert (run.status, run.attempt, client.list_steps(run_id)) == ("running", 1, [])
    (marks / "c-go").touch()
    run = wait_for(client, run_id, timeout=30)
    assert run.status == "completed" and run.output == 1
    assert [(s.attempt, s.status) for s in client.list_steps(run_id)] == [(1, "completed")]


def heartbeat_at(client: Durable, run_id: str) -> Any:
    from durable_celery.store import queries

    with client.db.engine.connect() as conn:
        return queries.fetch_run(conn, run_id).heartbeat_at


def queued_task_id(env: dict[str, str], run_id: str, seconds: float = 20) -> str:
    """The task id of the run's step message waiting in the broker's queue."""
    broker = redis.Redis.from_url(REDIS_URL)

    def find() -> str | None:
        for raw in broker.lrange(env["QUEUE"], 0, -1):
            message = json.loads(raw)
            if run_id in message["headers"].get("kwargsrepr", "") + json.dumps(message.get("body", "")):
                return str(message["headers"]["id"])
        return None

    try:
        return str(until(find, seconds, "the run's message in the queue"))
    finally:
        broker.close()


@pytest.mark.timeout(120)
def test_a_revoked_step_message_that_had_not_started_is_sent_again_at_once(
    client: Durable, start: Any, env: dict[str, str], tmp_path: Path
) -> None:
    start_worker(start, env, "prefork")
    marks = Path(env["MARKS"])
    busy = client.start("hold", {"tag": "busy"})
    wait_file(marks / "busy-task-1", 30)  # the worker's one process is taken: the next message waits
    run_id = client.start("hold", {"tag": "next"})
    task_id = queued_task_id(env, run_id)
    assert "flagged as revoked" in control(env, tmp_path, "revoke", task_id)
    (marks / "busy-go").touch()
    assert wait_for(client, busy, timeout=30).status == "completed"
    freed_at = time.monotonic()
    # The worker drops the revoked message; the run is still due, so it is sent again.
    second = wait_file(marks / "next-task-1", 15)
    took = time.monotonic() - freed_at
    print(f"\nrevoke: the run's step running {took:.2f}s after the worker dropped its message")
    assert second != task_id and took < 10  # a new message, not the relay's 300 s re-send
    (marks / "next-go").touch()
    assert wait_for(client, run_id, timeout=30).status == "completed"
    (revoked,) = client.activity(kinds=["message_revoked"], run_id=run_id)
    assert revoked.details["task_id"] == task_id and revoked.details["reason"] == "revoked"
    assert "durable cancel" in revoked.details["hint"]
    assert [(s.attempt, s.status) for s in client.list_steps(run_id)] == [(1, "completed")]


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The worker's /metrics samples, by name and labels."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return {}
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            sample, _, value = line.rpartition(" ")
            name, _, labels = sample.partition("{")
            samples[name, frozenset(re.findall(r'(\w+)="([^"]*)"', labels))] = float(value)
    return samples


def sample(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


def watched_worker(client: Durable, start: Any, env: dict[str, str], retry: int) -> tuple[str, int]:
    """Flower and a prefork worker serving metrics, once Flower shows a step task (it has only
    the events sent after it subscribed): Flower's URL and the metrics port."""
    flower_port, metrics_port = free_port(), free_port()
    flower = f"http://127.0.0.1:{flower_port}"
    start("flower", "flower", f"--port={flower_port}", "--address=127.0.0.1")
    start_worker(start, env, "prefork", RETRY=str(retry), METRICS_PORT=str(metrics_port))

    def flower_sees_a_task() -> bool:
        run_id = client.start("ping")
        wait_for(client, run_id, timeout=30)
        tasks = http_json(f"{flower}/api/tasks?limit=100") or {}
        return any(run_id in (t.get("kwargs") or "") for t in tasks.values())

    until(flower_sees_a_task, 60, "Flower showing a step task")
    return flower, metrics_port


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_flower_metrics_and_the_dashboard_tell_the_same_story_of_a_terminated_step(
    client: Durable, start: Any, env: dict[str, str], tmp_path: Path
) -> None:
    flower, metrics_port = watched_worker(client, start, env, retry=1)
    run_id = client.start("hold", {"tag": "d"})
    task_id = wait_file(Path(env["MARKS"]) / "d-task-1", 30)
    assert f"terminate: {task_id}" in control(env, tmp_path, "terminate", "SIGKILL", task_id)
    run = wait_for(client, run_id, timeout=15)
    assert run.status == "failed"

    # Flower: the task was revoked, terminated.
    info = until(
        lambda: (i := http_json(f"{flower}/api/task/info/{task_id}")) and i.get("state") == "REVOKED" and i,
        20,
        "Flower showing the task REVOKED",
    )
    assert info["name"] == "durable.hold.wait_here"
    # The database: the attempt ended Terminated, and so did the run.
    (step,) = client.list_steps(run_id)
    assert (step.status, step.error["type"]) == ("failed", "Terminated")
    assert run.error["type"] == "Terminated" and "control command (SIGKILL)" in run.error["message"]
    # The worker's metrics count the failed attempt and the failed run.
    failed_step = sample("durable_steps_finished_total", workflow="hold", step="wait_here", status="failed")
    failed_run = sample("durable_runs_finished_total", workflow="hold", status="failed")
    samples = until(lambda: (s := scrape(metrics_port)).get(failed_step) and s, 20, "the metrics")
    assert samples[failed_step] == 1 and samples[failed_run] == 1
    # The dashboard's run page shows the attempt and why it ended.
    page = TestClient(create_app(client)).get(f"/runs/{run_id}").text
    assert "Terminated: the process running step &#39;wait_here&#39; died" in page
    assert "terminated by a control command (SIGKILL)" in page


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_killed_pool_process_with_an_attempt_left_is_a_retry_in_flower_and_no_failed_ack(
    client: Durable, start: Any, env: dict[str, str]
) -> None:
    """The OOM killer, say: durable records the attempt and tries again, so Flower shows the
    task RETRY (not FAILURE) and durable_ack_failed_total does not count it."""
    flower, metrics_port = watched_worker(client, start, env, retry=2)
    run_id = client.start("hold", {"tag": "oom"})
    marks = Path(env["MARKS"])
    task_id = wait_file(marks / "oom-task-1", 30)
    os.kill(int((marks / "oom-pid-1").read_text()), signal.SIGKILL)
    second = wait_file(marks / "oom-task-2", 30)  # durable's own retry, in a new message
    (marks / "oom-go").touch()
    assert wait_for(client, run_id, timeout=30).output == 2

    states = until(
        lambda: (
            (a := http_json(f"{flower}/api/task/info/{task_id}") or {}).get("state") == "RETRY"
            and (b := http_json(f"{flower}/api/task/info/{second}") or {}).get("state") == "SUCCESS"
            and (a, b)
        ),
        20,
        "Flower showing the killed attempt RETRY and the next SUCCESS",
    )
    assert "WorkerLostError" in states[0]["exception"]
    failed_step = sample("durable_steps_finished_total", workflow="hold", step="wait_here", status="failed")
    samples = until(lambda: (s := scrape(metrics_port)).get(failed_step) and s, 20, "the metrics")
    assert samples[failed_step] == 1
    assert samples.get(sample("durable_ack_failed_total", task="durable.hold.wait_here"), 0) == 0
