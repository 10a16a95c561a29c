"""Flower shows what really happened: each step task's Celery state matches its attempt.

A real `celery worker -E` (prefork, so states and exceptions cross the pool's pipes) and a real
`celery flower` run here on PostgreSQL and Redis; the states are read from Flower's HTTP API.
Every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery import signals as celery_signals

from durable_celery import Durable, current_run
from durable_celery.testing import wait_for, worker
from tests.conftest import REDIS_URL
from tests.e2e.support import free_port, http_json, until

ROOT = Path(__file__).resolve().parents[2]

# The app `celery worker` and `celery flower` load; its workflows are `define` below.
APP = textwrap.dedent(
    """
    import os
    from celery import Celery
    from durable_celery import Durable
    from tests.e2e.test_flower_states import define

    app = Celery("flowerstates", broker=os.environ["FS_BROKER"])
    app.conf.task_default_queue = os.environ["FS_QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    durable = Durable(app, os.environ["FS_DB"], poll_interval=0.1, heartbeat_interval=0.3, relay_after=30.0)
    define(durable, os.environ["FS_MARKS"])
    """
)


def define(durable: Durable, marks: str) -> None:
    """The workflows of these tests, in the worker and in the test (which only starts them)."""
    ok = durable.workflow("fs_ok")
    ok.step(lambda **_: "one", name="first")
    ok.step(lambda **_: "two", name="second")

    flaky = durable.workflow("fs_flaky")

    @flaky.step(retry=3, backoff=0.1)
    def wobble() -> str:
        if current_run().attempt == 1:
            raise RuntimeError("wobbly on the first attempt")
        return "steady"

    doomed = durable.workflow("fs_doomed")

    @doomed.step(retry=2, backoff=0.1)
    def explode() -> None:
        raise ValueError(f"no way (attempt {current_run().attempt})")

    undo = durable.workflow("fs_undo")

    def refund() -> None:
        return None

    undo.step(lambda **_: "charged", name="charge", compensate=refund)

    @undo.step
    def ship() -> None:
        raise LookupError("no such address")

    snoozy = durable.workflow("fs_snoozy")

    @snoozy.step
    def later() -> str:
        mark = Path(marks) / current_run().id
        if not mark.exists():  # the first pass is told to come back later
            mark.touch()
            current_run().snooze(0.2, "rate limited")
        return "done"

    sleepy = durable.workflow("fs_sleepy")

    @sleepy.step
    def nap() -> str:
        current_run().sleep(0.3)  # parks the run: the worker is freed until it wakes
        return "rested"


class Stack:
    """Flower and a worker for one test's database and queue, and a Durable that starts runs."""

    def __init__(self, env: dict[str, str], folder: Path, durable: Durable) -> None:
        self.env, self.folder, self.durable = env, folder, durable
        self.flower = f"http://127.0.0.1:{env['FS_FLOWER_PORT']}"
        self.processes: list[subprocess.Popen[Any]] = []

    def start(self, name: str, *args: str) -> None:
        with (self.folder / f"{name}.log").open("w") as log:
            command = [sys.executable, "-m", "celery", "-A", "flowerstates", *args]
            self.processes.append(
                subprocess.Popen(command, cwd=self.folder, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            )

    def logs(self) -> str:
        return "\n".join(
            f"--- {n}\n{(self.folder / f'{n}.log').read_text()[-4000:]}" for n in ("worker", "flower")
        )

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    def tasks(self, **query: str) -> dict[str, Any]:
        """Flower's task list (``/api/tasks``), filtered by ``query``."""
        params = "&".join(f"{k}={v}" for k, v in {"limit": "1000", **query}.items())
        return http_json(f"{self.flower}/api/tasks?{params}") or {}

    def run_tasks(self, run_id: str) -> list[dict[str, Any]]:
        """The step tasks Flower knows for a run, in the order the worker received them."""
        found = [{"id": i, **t} for i, t in self.tasks().items() if run_id in (t.get("kwargs") or "")]
        return sorted(found, key=lambda t: t.get("received") or 0)

    def states(self, run_id: str) -> list[tuple[str, str]]:
        return [(t["name"].rsplit(".", 1)[1], t["state"]) for t in self.run_tasks(run_id)]


@pytest.fixture(params=["redis", "rabbitmq"])
def stack(pg_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """Flower and a prefork worker sending events, on Redis and on RabbitMQ (a vhost of the
    test session's own): the states Flower shows are the same on both."""
    broker = REDIS_URL if request.param == "redis" else request.getfixturevalue("rabbitmq")
    (tmp_path / "flowerstates.py").write_text(APP)
    (tmp_path / "marks").mkdir()
    env = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    env.update(
        PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}",
        PYTHONUNBUFFERED="1",
        FS_BROKER=broker,
        FS_QUEUE=f"fs-{uuid.uuid4().hex[:8]}",
        FS_DB=pg_url,
        FS_MARKS=str(tmp_path / "marks"),
        FS_FLOWER_PORT=str(free_port()),
        FLOWER_UNAUTHENTICATED_API="true",  # Flower 2 answers its API only with this, or auth
    )
    app = Celery("flowerstates", broker=broker)
    app.conf.task_default_queue = env["FS_QUEUE"]
    durable = Durable(app, pg_url, upkeep=False)
    define(durable, env["FS_MARKS"])
    stack = Stack(env, tmp_path, durable)
    stack.start("flower", "flower", f"--port={env['FS_FLOWER_PORT']}", "--address=127.0.0.1")
    stack.start(
        "worker", "worker", "-E", "-P", "prefork", "-c", "2", "-Q", env["FS_QUEUE"],
        "-n", f"{env['FS_QUEUE']}@%h", "--without-mingle", "--without-gossip", "-l", "info",
    )  # fmt: skip
    try:
        yield stack
    finally:
        stack.stop()
        durable.db.dispose()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_flower_shows_success_retry_failure_and_ignored_as_the_attempts_came_out(stack: Stack) -> None:
    durable, logs = stack.durable, stack.logs

    def flower_sees_a_run() -> bool:
        # Flower only has the events sent after it subscribed: start runs until one shows.
        run_id = durable.start("fs_ok")
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if stack.run_tasks(run_id):
                return True
            time.sleep(0.1)
        return False

    until(flower_sees_a_run, 40, "Flower showing a step task", logs)

    ok, flaky, doomed, undo, snoozy, sleepy = (
        durable.start(name)
        for name in ("fs_ok", "fs_flaky", "fs_doomed", "fs_undo", "fs_snoozy", "fs_sleepy")
    )
    expected_runs = {
        ok: "completed", flaky: "completed", doomed: "failed",
        undo: "compensated", snoozy: "completed", sleepy: "completed",
    }  # fmt: skip
    for run_id, status in expected_runs.items():
        assert wait_for(durable, run_id, timeout=20).status == status, logs()
    # A second copy of a finished run's step message: the engine drops it.
    duplicate = durable.app.send_task(
        "durable.fs_ok.first", kwargs={"run_id": ok, "step": 0, "attempt": 1}
    ).id

    expected = {
        ok: [("first", "SUCCESS"), ("second", "SUCCESS"), ("first", "IGNORED")],  # and the copy
        flaky: [("wobble", "RETRY"), ("wobble", "SUCCESS")],  # durable's backoff sent the second
        doomed: [("explode", "RETRY"), ("explode", "FAILURE")],
        undo: [("charge", "SUCCESS"), ("ship", "FAILURE"), ("charge", "SUCCESS")],  # then the refund
        snoozy: [("later", "IGNORED"), ("later", "SUCCESS")],
        sleepy: [("nap", "IGNORED"), ("nap", "SUCCESS")],
    }

    def all_states_shown() -> bool:
        return all(stack.states(run_id) == states for run_id, states in expected.items()) and (
            (http_json(f"{stack.flower}/api/task/info/{duplicate}") or {}).get("state") == "IGNORED"
        )

    def shown() -> str:
        lines = [f"{run_id}: {stack.states(run_id)} (expected {s})" for run_id, s in expected.items()]
        return "\n".join(lines) + "\n" + logs()

    until(all_states_shown, 20, "every step task in its state", shown)

    # SUCCESS carries a short summary: the run, the step, and the next step or the run's status.
    first, second, copy = stack.run_tasks(ok)
    assert copy["id"] == duplicate
    assert first["result"] == repr({"run_id": ok, "step": "first", "next": "second"})
    assert second["result"] == repr({"run_id": ok, "step": "second", "run": "completed"})
    refund = stack.run_tasks(undo)[2]
    assert refund["result"] == repr(
        {"run_id": undo, "step": "charge", "phase": "compensate", "run": "compensated"}
    )

    # RETRY and FAILURE carry the step's exception and its traceback, on the task's page too.
    retried = stack.run_tasks(flaky)[0]
    info = http_json(f"{stack.flower}/api/task/info/{retried['id']}")
    assert info["state"] == "RETRY" and info["exception"] == "RuntimeError('wobbly on the first attempt')"
    assert (
        "in wobble" in info["traceback"] and "RuntimeError: wobbly on the first attempt" in info["traceback"]
    )
    failed = stack.run_tasks(doomed)[1]
    info = http_json(f"{stack.flower}/api/task/info/{failed['id']}")
    assert info["state"] == "FAILURE" and info["exception"] == "ValueError('no way (attempt 2)')"
    assert "in explode" in info["traceback"] and "ValueError: no way (attempt 2)" in info["traceback"]
    shipped = http_json(f"{stack.flower}/api/task/info/{stack.run_tasks(undo)[1]['id']}")
    assert shipped["exception"] == "LookupError('no such address')" and "in ship" in shipped["traceback"]

    # IGNORED says what came of the message instead.
    ignored = http_json(f"{stack.flower}/api/task/info/{duplicate}")
    assert ignored["result"] == repr({"run_id": ok, "step": "first", "outcome": "dropped"})
    assert "'outcome': 'snoozed'" in stack.run_tasks(snoozy)[0]["result"]
    assert "'outcome': 'waiting'" in stack.run_tasks(sleepy)[0]["result"]

    # Flower's state filter finds them; durable's retries were never Celery re-publishes.
    assert failed["id"] in stack.tasks(state="FAILURE")
    assert retried["id"] in stack.tasks(state="RETRY")
    assert duplicate in stack.tasks(state="IGNORED") and duplicate in stack.tasks(search="state:IGNORED")
    assert all(t["retries"] in (0, None) for run_id in expected for t in stack.run_tasks(run_id))
    assert [(s.attempt, s.status) for s in durable.list_steps(doomed)] == [(1, "failed"), (2, "failed")]
    assert durable.get_run(doomed).error["type"] == "ValueError"  # the database's record is unchanged
    # Every message was acked, whatever its state: none waits in the broker to be delivered again.
    broker = redis.Redis.from_url(REDIS_URL)
    held = [json.loads(v)[2] for v in broker.hvals("unacked")]  # [message, exchange, routing key]
    assert stack.env["FS_QUEUE"] not in held and broker.llen(stack.env["FS_QUEUE"]) == 0


@pytest.mark.parametrize("backend", ["sqlite"])
@pytest.mark.timeout(60)
def test_a_failed_step_is_a_celery_failure_but_no_failed_ack(make_durable: Any) -> None:
    """In-process (thread pool): the Celery states of the step tasks, and the failed-ack metric
    counts only a message the engine could not handle."""
    durable = make_durable()
    metrics = durable.metrics
    fails = durable.workflow("fails")

    @fails.step(retry=2, backoff=0.05)
    def boom() -> None:
        raise RuntimeError("always")

    seen: list[tuple[str, str]] = []

    def record(sender: Any = None, state: str = "", **_: Any) -> None:
        if sender is not None and sender.name.startswith("durable.fails."):
            seen.append((sender.name, state))

    celery_signals.task_postrun.connect(record, weak=False)
    try:
        run_id = durable.start(fails)
        with worker(durable):
            assert wait_for(durable, run_id).status == "failed"
            durable.app.send_task("durable.fails.boom", kwargs={"run_id": run_id})  # a late copy
            durable.app.send_task("durable.fails.boom", kwargs={"run_id": run_id, "unexpected": 1})
            deadline = time.monotonic() + 20
            while len(seen) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        celery_signals.task_postrun.disconnect(record)
    states = [state for _, state in seen]
    assert states[:2] == ["RETRY", "FAILURE"] and sorted(states[2:]) == ["FAILURE", "IGNORED"]
    assert metrics.value("durable_ack_failed_total", {"task": "durable.fails.boom"}) == 1  # the bad message
    assert durable.get_run(run_id).error["message"] == "always"
