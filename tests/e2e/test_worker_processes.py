"""Real `celery worker` processes killed and stopped: crash recovery, graceful shutdown, and a
worker that lacks a workflow's code. PostgreSQL and Redis; a graceful shutdown's hand-back and a
killed pool process (``WorkerLost``) also on RabbitMQ (BROKERS). Fails (never skips) without
them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from durable_celery import Durable
from durable_celery.testing import wait_for
from tests.conftest import BROKERS

ROOT = Path(__file__).resolve().parents[2]

APP = textwrap.dedent(
    """
    import logging, os, time
    from pathlib import Path
    from celery import Celery
    from durable_celery import Durable, current_run

    app = Celery("procapp", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    app.conf.worker_prefetch_multiplier = 1
    durable = Durable(
        app,
        os.environ["DB"],
        poll_interval=0.2,
        heartbeat_interval=0.4,
        stale_lock_timeout=float(os.environ.get("STALE", "300")),
        sweep_interval=0.5,
        shutdown_grace_period=float(os.environ.get("GRACE", "2")),
    )
    marks = Path(os.environ["MARKS"])

    from durable_celery import signals

    @signals.worker_draining.connect
    def note_draining(sender, node, grace, **kw):
        # Where users' own shutdown clean-up goes: it runs before the steps' grace period.
        (marks / "draining").write_text(f"{node} {grace} {sender is durable}")

    job = durable.workflow("job")

    @job.step
    def work(mode):
        # The first worker to run this step loops until it is stopped; later ones finish.
        first = not (marks / "started").exists()
        (marks / "started").touch()
        logging.getLogger("procapp").warning("working (mode %s)", mode)
        if first and mode == "drain":
            durable.drain()  # what a preStop hook calls: this worker shuts down gracefully
        while first or mode == "forever":
            if mode == "polite" and current_run().shutting_down():
                current_run().snooze(0, "worker shutting down")
            time.sleep(0.05)
        return os.getpid()

    crash = durable.workflow("crash")

    @crash.step(retry=int(os.environ.get("RETRY", "1")))
    def die_here(tag):
        # Each attempt leaves its process id; it runs until the test lets it go (or kills it).
        (marks / f"pid-{current_run().attempt}").write_text(str(os.getpid()))
        while not (marks / "go").exists():
            time.sleep(0.05)
        return current_run().attempt

    # The same, as the second step: it runs inline, in the execution of the first one's message.
    crash_later = durable.workflow("crash_later")
    crash_later.step(lambda tag: "warm", name="warm_up")
    crash_later.step(crash.steps[0].fn, name="die_later", retry=int(os.environ.get("RETRY", "1")))

    undo = durable.workflow("undo")

    def refund(tag):
        (marks / f"comp-{current_run().attempt}").write_text(str(os.getpid()))
        while not (marks / "go").exists():
            time.sleep(0.05)

    @undo.step(compensate=refund, compensate_retry=int(os.environ.get("RETRY", "1")))
    def charge(tag):
        return "charged"

    @undo.step
    def explode(tag):
        raise RuntimeError("card declined")

    if os.environ.get("WITH_LATE", ""):
        late = durable.workflow("late")

        @late.step
        def arrive():
            return "arrived"
    """
)


@pytest.fixture
def backend() -> str:
    """PostgreSQL and Redis, unless a test takes ``backend`` from BROKERS."""
    return "postgres"


@pytest.fixture
def proc_env(pg_url: str, tmp_path: Path, broker_url: str) -> dict[str, str]:
    (tmp_path / "procapp.py").write_text(APP)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    return {
        **env,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
        "BROKER": broker_url,
        "QUEUE": f"q-{uuid.uuid4().hex[:8]}",
        "DB": pg_url,
        "MARKS": str(marks),
    }


@pytest.fixture
def start_worker(proc_env: dict[str, str], tmp_path: Path) -> Iterator:
    started: list[subprocess.Popen] = []

    def start(name: str, pool: str = "threads", **env: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, "-m", "celery", "-A", "procapp", "worker", "-P", pool, "-c", "2"]
        cmd += ["-n", f"{name}@%h", "-Q", proc_env["QUEUE"], "--loglevel", "INFO", "--without-mingle"]
        proc = subprocess.Popen(cmd, cwd=tmp_path, env={**proc_env, **env}, stdout=log, stderr=log)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def client(proc_env: dict[str, str]) -> Iterator[Durable]:
    """A producer-side Durable on the same database and queue (no worker of its own)."""
    app = Celery("procapp", broker=proc_env["BROKER"])
    app.conf.task_default_queue = proc_env["QUEUE"]
    durable = Durable(app, proc_env["DB"], upkeep=False)
    job = durable.workflow("job")
    job.step(lambda mode: None, name="work")
    crash = durable.workflow("crash")
    crash.step(lambda tag: None, name="die_here")
    crash_later = durable.workflow("crash_later")
    crash_later.step(lambda tag: None, name="warm_up")
    crash_later.step(lambda tag: None, name="die_later")
    undo = durable.workflow("undo")
    undo.step(lambda tag: None, name="charge")
    undo.step(lambda tag: None, name="explode")
    yield durable
    durable.db.dispose()


def _wait_started(proc_env: dict[str, str], seconds: float = 30) -> None:
    marker = Path(proc_env["MARKS"]) / "started"
    deadline = time.monotonic() + seconds
    while not marker.exists():
        assert time.monotonic() < deadline, "no worker started the step"
        time.sleep(0.05)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["threads", "prefork"])
@pytest.mark.parametrize("backend", BROKERS)
def test_sigterm_hands_a_long_step_back_after_the_grace_period(client, start_worker, proc_env, pool):
    first = start_worker("first", pool, GRACE="2")
    run_id = client.start("job", {"mode": "stubborn"})
    _wait_started(proc_env)
    stopped_at = time.monotonic()
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0
    assert time.monotonic() - stopped_at < 15  # the grace period (2 s), not the step, decided
    node, grace, ours = (Path(proc_env["MARKS"]) / "draining").read_text().split()
    assert node.startswith("first@") and float(grace) == 2.0 and ours == "True"  # signals.worker_draining
    handed = client.activity(kinds=["handed_back"], run_id=run_id)
    assert len(handed) == 1
    assert [r["body"] for r in handed[0].details["logs"]] == ["working (mode stubborn)"]
    second = start_worker("second")
    run = wait_for(client, run_id, timeout=40)  # far sooner than the 300 s stale timeout
    assert run.status == "completed" and run.output == second.pid
    steps = client.list_steps(run_id)
    assert [(s.attempt, s.status) for s in steps] == [(1, "completed")]  # no attempt used


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_step_that_sees_shutting_down_snoozes_and_continues_elsewhere(client, start_worker, proc_env, pool):
    first = start_worker("first", pool, GRACE="60")
    run_id = client.start("job", {"mode": "polite"})
    _wait_started(proc_env)
    stopped_at = time.monotonic()
    first.send_signal(signal.SIGTERM)
    assert first.wait(40) == 0
    assert time.monotonic() - stopped_at < 30  # it stopped itself well within its 60 s grace
    assert [a.details["reason"] for a in client.activity(kinds=["snoozed"], run_id=run_id)] == [
        "worker shutting down"
    ]
    second = start_worker("second")
    assert wait_for(client, run_id, timeout=40).output == second.pid


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_drain_from_code_shuts_the_worker_down_and_hands_the_step_back(client, start_worker, proc_env, pool):
    first = start_worker("first", pool, GRACE="1")
    run_id = client.start("job", {"mode": "drain"})
    assert first.wait(40) == 0  # no signal sent: drain() alone stopped it
    assert (Path(proc_env["MARKS"]) / "draining").read_text().split()[1:] == ["1.0", "True"]
    assert len(client.activity(kinds=["handed_back"], run_id=run_id)) == 1
    second = start_worker("second")
    assert wait_for(client, run_id, timeout=40).output == second.pid


@pytest.mark.timeout(150)
def test_sigkill_mid_step_is_recovered_after_the_stale_timeout_without_using_an_attempt(
    client, start_worker, proc_env
):
    first = start_worker("first", STALE="2")
    run_id = client.start("job", {"mode": "once"})
    _wait_started(proc_env)
    first.kill()  # SIGKILL: no shutdown, the lock stays behind
    first.wait(10)
    assert client.get_run(run_id).status == "running"
    second = start_worker("second", STALE="2")
    run = wait_for(client, run_id, timeout=60)
    assert run.status == "completed" and run.output == second.pid and run.attempt == 1
    (recovered,) = client.activity(kinds=["stale_recovered"], run_id=run_id)  # the loss, once
    assert recovered.details["losses"] == 1 and not recovered.details["failed"]
    with client.db.engine.connect() as conn:
        from durable_celery.store import queries

        assert queries.fetch_run(conn, run_id).losses == 0  # a completed run counts no losses


@pytest.mark.timeout(240)
def test_a_run_lost_three_times_fails(client, start_worker, proc_env):
    run_id = client.start("job", {"mode": "forever"})
    for n in range(3):
        worker = start_worker(f"w{n}", STALE="1.5")
        deadline = time.monotonic() + 60
        while _losses_and_lock(client, run_id) != (n, True):
            assert time.monotonic() < deadline, f"loss {n}: {_losses_and_lock(client, run_id)}"
            time.sleep(0.05)
        worker.kill()
        worker.wait(10)
    sweeper = start_worker("sweeper", STALE="1.5")
    run = wait_for(client, run_id, timeout=60)
    assert run.status == "failed" and run.error["type"] == "WorkerLost"
    assert sweeper.poll() is None


def _losses_and_lock(client: Durable, run_id: str) -> tuple[int, bool]:
    from durable_celery.store import queries

    with client.db.engine.connect() as conn:
        row = queries.fetch_run(conn, run_id)
    return row.losses, row.locked_by is not None


def _wait_file(path: Path, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path.name} did not appear within {seconds}s"
        time.sleep(0.02)
    return path.read_text()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BROKERS)
def test_a_killed_pool_process_uses_an_attempt_and_the_next_one_starts_within_seconds(
    client, start_worker, proc_env
):
    start_worker("first", "prefork", RETRY="2", STALE="300")
    marks = Path(proc_env["MARKS"])
    run_id = client.start("crash", {"tag": "oom"})
    pid = int(_wait_file(marks / "pid-1", 30))
    os.kill(pid, signal.SIGKILL)  # what the OOM killer does to a pool process
    killed_at = time.monotonic()
    second = int(_wait_file(marks / "pid-2", 10))  # not the 300 s stale timeout
    assert time.monotonic() - killed_at < 10 and second != pid
    (marks / "go").touch()
    run = wait_for(client, run_id, timeout=30)
    assert run.status == "completed" and run.output == 2
    steps = client.list_steps(run_id)
    assert [(s.attempt, s.status) for s in steps] == [(1, "failed"), (2, "completed")]
    assert steps[0].error["type"] == "WorkerLost"
    assert "signal 9" in steps[0].error["message"] and str(pid) in steps[0].error["message"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BROKERS)
def test_a_pool_process_killed_in_an_inline_step_uses_that_steps_attempt_within_seconds(
    client, start_worker, proc_env
):
    start_worker("first", "prefork", RETRY="2", STALE="300")
    marks = Path(proc_env["MARKS"])
    run_id = client.start("crash_later", {"tag": "oom"})
    pid = int(_wait_file(marks / "pid-1", 30))  # the second step, run inline by the first's message
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    second = int(_wait_file(marks / "pid-2", 10))
    assert time.monotonic() - killed_at < 10 and second != pid
    (marks / "go").touch()
    run = wait_for(client, run_id, timeout=30)
    assert run.status == "completed" and run.output == 2
    steps = [(s.name, s.attempt, s.status) for s in client.list_steps(run_id)]
    assert steps == [("warm_up", 1, "completed"), ("die_later", 1, "failed"), ("die_later", 2, "completed")]
    records = client.list_steps(run_id)
    assert records[1].error["type"] == "WorkerLost"
    assert records[0].worker == records[1].worker and records[1].worker.endswith(f":{pid}")  # inline


@pytest.mark.timeout(120)
def test_a_killed_pool_process_fails_a_run_with_no_attempt_left_within_seconds(
    client, start_worker, proc_env
):
    worker = start_worker("first", "prefork", RETRY="1", STALE="300")
    marks = Path(proc_env["MARKS"])
    run_id = client.start("crash", {"tag": "segfault"})
    pid = int(_wait_file(marks / "pid-1", 30))
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    run = wait_for(client, run_id, timeout=10)
    assert time.monotonic() - killed_at < 10
    assert run.status == "failed" and run.error["type"] == "WorkerLost"
    assert "signal 9" in run.error["message"]
    assert [(s.attempt, s.status) for s in client.list_steps(run_id)] == [(1, "failed")]
    assert not (marks / "pid-2").exists() and worker.poll() is None  # the worker lives on


@pytest.mark.timeout(60)
def test_a_worker_on_an_older_schema_exits_at_once_naming_the_revisions_and_the_command(
    start_worker, proc_env, tmp_path
):
    from alembic import command

    from durable_celery.store.db import Database
    from durable_celery.store.migrate import alembic_config

    db = Database(proc_env["DB"])
    command.downgrade(alembic_config(db), "0003")  # the schema of the previous release
    db.dispose()
    started = time.monotonic()
    worker = start_worker("behind", "prefork")
    assert worker.wait(30) == 1
    assert time.monotonic() - started < 30
    output = (tmp_path / "behind.log").read_text()
    assert "pending revisions: 0004" in output
    assert "run `celery -A procapp durable migrate`" in output
    assert output.count("Traceback") == 0


@pytest.mark.timeout(120)
def test_a_killed_compensation_is_recorded_failed_and_ends_the_run_with_no_attempt_left(
    client, start_worker, proc_env
):
    start_worker("first", "prefork", RETRY="1", STALE="300")
    marks = Path(proc_env["MARKS"])
    run_id = client.start("undo", {"tag": "order-9"})
    pid = int(_wait_file(marks / "comp-1", 30))
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    run = wait_for(client, run_id, timeout=10)
    assert time.monotonic() - killed_at < 10
    assert run.status == "compensation_failed"
    undo = [s for s in client.list_steps(run_id) if s.phase == "compensate"]
    assert [(s.name, s.attempt, s.status) for s in undo] == [("charge", 1, "failed")]
    assert undo[0].error["type"] == "WorkerLost" and "signal 9" in undo[0].error["message"]


@pytest.mark.timeout(60)
def test_a_worker_given_a_mistyped_database_url_exits_at_once_saying_so(start_worker, tmp_path):
    worker = start_worker("typo", DB="postgresq://postgres:hunter2@127.0.0.1:5432/x")
    assert worker.wait(30) == 1
    output = (tmp_path / "typo.log").read_text()
    assert "unknown database scheme 'postgresq' in postgresq://postgres:***@" in output
    assert "hunter2" not in output and "Traceback" not in output
