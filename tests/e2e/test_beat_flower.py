"""Keyed schedules under a real `celery beat` (RedBeat on Redis, and Celery's default scheduler on
the embedded default), real workers, and a real Flower finding durable step tasks.

Every process is `celery -A tests.e2e.beat_app ...` started here; nothing is mocked, and every
wait polls for a condition with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from durable_celery import Durable, InvalidArgument, schedules
from durable_celery.store.db import utcnow
from tests.conftest import PG_HOST, REDIS_URL
from tests.e2e.support import free_port, http_json, until

ROOT = Path(__file__).resolve().parents[2]


def env_for(**extra: str) -> dict[str, str]:
    """PATH and HOME from this process, the checkout on PYTHONPATH, and ``extra``."""
    env = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    return {**env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra}


def celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "tests.e2e.beat_app", *args]


class Processes:
    """Celery processes started for a test, stopped (SIGTERM, then kill) at the end."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs, self.started = env, logs, []

    def start(self, name: str, *args: str) -> subprocess.Popen[Any]:
        with (self.logs / f"{name}.log").open("w") as log:
            process = subprocess.Popen(
                celery(*args), cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self.started.append(process)
        return process

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def stop(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.started:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


@dataclass
class Stack:
    """The running processes, Flower's address, and a Durable on the same database and prefix."""

    durable: Durable
    processes: Processes
    flower: str

    def logs(self, *names: str) -> Callable[[], str]:
        """The tail of these processes' logs, for a failure message."""
        return lambda: "\n".join(f"--- {n}\n{self.processes.log(n)[-3000:]}" for n in names)


@pytest.fixture(scope="module")
def stack(pg_template: str, redis_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """PostgreSQL + Redis, a worker (sending events), `beat -S redbeat.RedBeatScheduler` and Flower;
    and, in this process, a Durable on the same database and RedBeat prefix."""
    database = f"durable_beat_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database} TEMPLATE {pg_template}")
    url, prefix, queue, port = f"{PG_HOST}/{database}", f"e2e-{uuid.uuid4().hex[:8]}:", "", free_port()
    queue = f"beat-{uuid.uuid4().hex[:8]}"
    env = env_for(
        DURABLE_DATABASE_URL=url,
        BEAT_APP_BROKER=REDIS_URL,
        BEAT_APP_PREFIX=prefix,
        BEAT_APP_QUEUE=queue,
        FLOWER_UNAUTHENTICATED_API="true",
    )
    processes = Processes(env, tmp_path_factory.mktemp("beat"))
    processes.start("flower", "flower", f"--port={port}", "--address=127.0.0.1")
    processes.start("worker", "worker", "-P", "threads", "-c", "6", "-E", "-l", "info", "-n", f"{queue}@%h")
    processes.start("beat", "beat", "-S", "redbeat.RedBeatScheduler", "-l", "info")

    app = Celery("beat_app", broker=REDIS_URL)
    app.conf.update(task_default_queue=queue, redbeat_redis_url=REDIS_URL, redbeat_key_prefix=prefix)
    durable = Durable(app, url, upkeep=False)
    for name in ("slow", "strict", "quick", "failing"):
        durable.workflow(name).step(lambda **_: None, name="work")
    try:
        yield Stack(durable, processes, f"http://127.0.0.1:{port}")
    finally:
        processes.stop()
        durable.db.dispose()
        with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


def duplicates(durable: Durable, workflow: str, outcome: str) -> list[Any]:
    found = durable.activity(kinds=["key_duplicate"], workflow=workflow, limit=1000)
    return [a for a in found if a.details["outcome"] == outcome]


def assert_one_at_a_time(runs: list[Any]) -> None:
    started = sorted((r for r in runs if r.started_at is not None), key=lambda r: r.started_at)
    for earlier, later in zip(started, started[1:], strict=False):
        assert earlier.finished_at is not None and earlier.finished_at <= later.started_at, (earlier, later)


@pytest.mark.timeout(90)
def test_a_fire_every_second_never_runs_two_copies_of_a_keyed_run(stack: Stack) -> None:
    """A 2.5 s step fired every second: one run at a time per key, the other fires duplicates."""
    durable = stack.durable

    def two_completed() -> bool:
        done = durable.list_runs(workflow="slow", key="tick", status="completed")
        return len(done) >= 2 and len(duplicates(durable, "slow", "use_existing")) >= 2

    until(two_completed, 45, "two completed `slow` runs and duplicates", stack.logs("beat", "worker"))
    assert_one_at_a_time(durable.list_runs(workflow="slow", key="tick", limit=1000))
    entry = durable.get_schedule("slow-every-second")
    assert (entry.name, entry.key, entry.failures, entry.enabled) == ("slow:tick", "tick", 0, True)
    assert durable.get_schedule("slow:tick").source == "redbeat"  # beat stored the config entry
    with pytest.raises(InvalidArgument, match="beat_schedule"):
        durable.update_schedule("slow:tick", input={})  # also where this process lacks the config
    with pytest.raises(InvalidArgument, match="beat_schedule"):
        durable.delete_schedule("slow:tick")


@pytest.mark.timeout(90)
def test_fires_refused_by_on_duplicate_error_are_skipped_and_not_counted(stack: Stack) -> None:
    durable = stack.durable

    def skipped_twice() -> bool:
        done = durable.list_runs(workflow="strict", status="completed")
        return len(done) >= 2 and len(duplicates(durable, "strict", "error")) >= 3

    until(skipped_twice, 45, "two completed `strict` runs and skipped fires", stack.logs("beat"))
    assert_one_at_a_time(durable.list_runs(workflow="strict", limit=1000))
    entry = durable.get_schedule("strict:only")
    assert entry.failures == 0 and entry.enabled
    assert durable.activity(kinds=["schedule_disabled"], workflow="strict") == []


@pytest.mark.timeout(90)
def test_five_failed_fires_in_a_row_switch_a_schedule_off(stack: Stack) -> None:
    durable = stack.durable

    def disabled() -> list[Any]:
        return durable.activity(kinds=["schedule_disabled"], workflow="failing")

    (off,) = until(disabled, 45, "the failing schedule switched off", stack.logs("beat", "worker"))
    assert off.details["schedule"] == "failing:f" and off.details["failures"] == 5
    entry = durable.get_schedule("failing:f")
    assert (entry.enabled, entry.failures, entry.last_outcome) == (False, 5, "failed")
    runs = durable.list_runs(workflow="failing", limit=1000)
    assert [r.status for r in runs] == ["failed"] * 5  # beat still sends fires: they start nothing
    assert any("failing:f" in line for line in schedules.problems(durable.runtime))
    env = stack.processes.env
    listed = subprocess.run(
        celery("durable", "schedules"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    (line,) = [line for line in listed.stdout.splitlines() if line.startswith("failing:f")]
    assert "disabled" in line and line.split()[-2:] == ["failed", "5"]
    assert "! schedule 'failing:f' (failing) is disabled after 5 failure(s) in a row" in listed.stdout


def check_run_time_schedule(durable: Durable, logs: Callable[[], str]) -> None:
    """Create, update and delete a schedule while beat runs; beat follows each change."""
    durable.schedule("quick", 1, key="dyn", input={"n": 1}, name="dyn")

    def completed_with(n: int) -> Callable[[], bool]:
        return lambda: any(
            r.input.get("n") == n for r in durable.list_runs(workflow="quick", key="dyn", status="completed")
        )

    until(completed_with(1), 20, "a run of the new schedule", logs)
    durable.update_schedule("dyn", input={"n": 2})
    until(completed_with(2), 20, "a run with the updated input", logs)
    assert durable.trigger_schedule("dyn")
    assert durable.delete_schedule("dyn")
    deleted_at = utcnow()

    def beat_fired_thrice_since() -> bool:
        tick = durable.get_schedule("slow:tick").last_fire_at
        return tick is not None and (tick - deleted_at).total_seconds() > 3

    until(beat_fired_thrice_since, 20, "more fires of another schedule", logs)
    late = [
        r
        for r in durable.list_runs(workflow="quick", key="dyn", limit=1000)
        if (r.created_at - deleted_at).total_seconds() > 1.5  # a fire already sent may land
    ]
    assert late == []


@pytest.mark.timeout(90)
def test_run_time_schedules_are_seen_by_the_running_beat(stack: Stack) -> None:
    check_run_time_schedule(stack.durable, stack.logs("beat", "worker"))


@pytest.mark.timeout(90)
def test_flower_shows_step_tasks_with_run_id_key_step_and_attempt(stack: Stack) -> None:
    durable = stack.durable
    flower, logs = stack.flower, stack.logs("flower")
    # The beat's fires are tasks too: once Flower lists one, it receives the worker's events.
    until(lambda: http_json(f"{flower}/api/tasks?limit=1"), 30, "Flower seeing task events", logs)
    run_id = durable.start("quick", {"n": 7}, key="flower-key")

    def step_tasks() -> list[Any]:
        tasks = http_json(f"{flower}/api/tasks?limit=1000") or {}
        return [t for t in tasks.values() if run_id in (t.get("kwargs") or "")]

    (task,) = until(step_tasks, 30, f"run {run_id}'s step task in Flower", logs)
    assert task["name"] == "durable.quick.work"
    assert "key: 'flower-key'" in task["kwargs"] and "step: work" in task["kwargs"]
    assert "attempt: 1" in task["kwargs"]
    tasks = http_json(f"{flower}/api/tasks?limit=1000&taskname=durable.fire_schedule") or {}
    fires = [t["kwargs"] for t in tasks.values() if t["name"] == "durable.fire_schedule"]
    assert "{schedule: slow:tick, workflow: slow, key: 'tick'}" in fires


@pytest.mark.timeout(60)
def test_the_schedules_command_lists_key_next_fire_outcome_and_failures(stack: Stack) -> None:
    durable = stack.durable
    until(lambda: durable.get_schedule("slow:tick").last_outcome, 20, "a fire")
    env = stack.processes.env
    done = subprocess.run(
        celery("durable", "schedules"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.splitlines()
    assert header.split()[:4] == ["name", "workflow", "key", "schedule"]
    assert "next fire" in header and "last outcome" in header and "failures" in header
    (slow,) = [line for line in lines if line.startswith("slow:tick")]
    assert slow.split()[1:4] == ["slow", "tick", "every"]
    assert slow.split()[-1] == "0"


@pytest.mark.timeout(90)
def test_default_scheduler_on_the_embedded_default(tmp_path: Path) -> None:
    """No Redis: Celery's own beat scheduler (as DurableScheduler, which adds run-time schedules),
    the SQLite file and the serverless broker."""
    env = env_for(DURABLE_HOME=str(tmp_path / "home"))
    migrate = subprocess.run(
        celery("durable", "migrate"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert migrate.returncode == 0, migrate.stderr
    processes = Processes(env, tmp_path)
    processes.start("worker", "worker", "-P", "threads", "-c", "4", "-l", "info")
    scheduler = "durable_celery.beat:DurableScheduler"  # Celery's default one, plus run-time schedules
    processes.start("beat", "beat", "-S", scheduler, "-s", str(tmp_path / "beat-schedule"), "-l", "info")
    app = Celery("reader", broker="memory://")
    app.conf.beat_scheduler = scheduler
    durable = Durable(app, f"sqlite:///{tmp_path}/home/durable.sqlite3", upkeep=False)
    durable.workflow("quick").step(lambda **_: None, name="work")
    try:

        def two_completed() -> bool:
            done = durable.list_runs(workflow="slow", key="tick", status="completed")
            return len(done) >= 2 and len(duplicates(durable, "slow", "use_existing")) >= 2

        logs = lambda: processes.log("beat")[-3000:] + processes.log("worker")[-3000:]  # noqa: E731
        until(two_completed, 45, "two completed runs under the default scheduler", logs)
        assert_one_at_a_time(durable.list_runs(workflow="slow", key="tick", limit=1000))
        check_run_time_schedule(durable, logs)
    finally:
        processes.stop()
        durable.db.dispose()
