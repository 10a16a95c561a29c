"""The worker bootstep that makes, starts and stops the upkeep threads (``install``), and what a
worker refuses to start with: a forking pool on a one-process store, a database URL it cannot
use, a schema behind its code. Driven in this process.

Written against mutants of durable_celery/worker/upkeep.py that the behaviour tests (real
workers only) let through."""

from __future__ import annotations

import os
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from durable_celery.testing import worker
from durable_celery.worker import upkeep
from tests.integration.worker.helpers import THREADS, find_node, until, upkeep_threads

pytestmark = pytest.mark.timeout(60)


def _bootstep(durable: Any) -> Any:
    (step,) = [s for s in durable.app.steps["worker"] if getattr(s, "__name__", None) == "DurableUpkeep"]
    return step


def _a_worker(durable: Any, name: str, pool: str = "threads", **more: Any) -> Any:
    from celery.concurrency import get_implementation

    return SimpleNamespace(
        hostname=name, app=durable.app, pool=get_implementation(pool)(limit=1), steps=[], **more
    )


def test_the_worker_bootstep_notes_the_worker_and_its_task_events_and_makes_its_upkeep(make_durable):
    durable = make_durable()
    step_class = _bootstep(durable)
    cases = [(True, False, 1), (False, True, 1), (None, True, 1), (None, False, 0), (False, False, 0)]
    for task_events, configured, on in cases:
        durable.app.conf.worker_send_task_events = configured
        durable.engine.task_events.value = 1 - on
        durable.engine.worker_pid = 0
        host = _a_worker(durable, "made@test", task_events=task_events)
        made = step_class(host).create(host)
        assert durable.engine.task_events.value == on, (task_events, configured)
        assert durable.engine.worker_pid == os.getpid()  # before the pool forks
        assert isinstance(made, upkeep.Upkeep) and made.rt is durable.runtime and made.worker is host
        assert made.node is not None and made.node.name == "made@test"
    durable.app.conf.worker_send_task_events = True
    no_option = SimpleNamespace(hostname="made@test", app=durable.app)  # a worker without the attribute
    step_class(no_option).create(no_option)
    assert durable.engine.task_events.value == 1
    off = make_durable(upkeep=False)
    host = _a_worker(off, "off@test")
    assert _bootstep(off)(host).create(host) is None


def test_the_worker_bootstep_starts_upkeep_afresh_and_marks_the_node_draining_as_it_stops(make_durable):
    durable = make_durable(poll_interval=0.05)
    step_class = _bootstep(durable)
    before = upkeep_threads()
    for how in ("stop", "terminate"):  # a warm shutdown, a cold one
        name = f"{how}@test"
        host = _a_worker(durable, name, task_events=False)
        step = step_class(host)
        assert step.include(host) and host.steps == [step]
        durable.engine.drain(60)  # a worker that shut down before in this process
        step.start(host)
        try:
            assert not durable.engine.shutting_down()
            until(lambda: find_node(durable, name), "the node registered")  # noqa: B023 (called here)
            assert {t.name for t in upkeep_threads() - before} == THREADS
        finally:
            getattr(step, how)(host)
        assert not upkeep_threads() - before
        node = find_node(durable, name)
        assert node is not None and node["draining"] is True
        assert durable.engine.shutting_down() is (how == "stop")  # only a warm one has a grace period
        durable.engine.undrain()


def test_a_worker_runs_upkeep_from_its_start_until_it_stops(make_durable):
    durable = make_durable(poll_interval=0.05)
    durable.engine.worker_pid = 0
    name = f"upkeep-{uuid.uuid4().hex[:6]}@test"
    before = upkeep_threads()
    with worker(durable, hostname=name):
        until(lambda: find_node(durable, name), "the worker's node registered")
        assert {t.name for t in upkeep_threads() - before} == THREADS
        assert durable.engine.worker_pid == os.getpid()
    assert not upkeep_threads() - before
    node = find_node(durable, name)
    assert node is not None and node["draining"] is True


# -- what a worker refuses to start with --------------------------------------------------------


def _said_once(capfd, line: str) -> None:
    """The refusal reached the terminal once: printed, or as the worker's log record when its log
    already goes there (a worker redirects sys.stderr to its log, so the line goes to fd 2)."""
    said = capfd.readouterr()
    assert said.out == ""
    assert said.err.count(line) == 1, said.err
    assert said.err.endswith(line + "\n")


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_forking_pool_is_refused_only_on_a_one_process_store(make_durable, capfd, pool):
    import uuid

    from celery import Celery
    from celery.concurrency import get_implementation
    from celery.exceptions import WorkerShutdown

    from durable_celery import Durable

    worker = type("Worker", (), {"pool": get_implementation(pool)(limit=1)})()
    memory = Durable(Celery("one_process", broker="memory://"), f"memory://{uuid.uuid4().hex}")
    try:
        if pool == "prefork":
            with pytest.raises(WorkerShutdown) as refused:
                upkeep.refuse_forking_pool(memory.runtime, worker)
            assert refused.value.args == (1,)  # the worker's exit code
            _said_once(
                capfd,
                f"durable: the {memory.db.masked_url} store is one process only (missing MULTI_PROCESS): "
                "start this worker with --pool threads (or solo), or give Durable a database URL",
            )
        else:
            upkeep.refuse_forking_pool(memory.runtime, worker)
        upkeep.refuse_forking_pool(make_durable().runtime, worker)  # a shared store: any pool will do
        upkeep.refuse_forking_pool(memory.runtime, type("Starting", (), {})())  # no pool yet
    finally:
        memory.db.dispose()


def test_the_worker_bootstep_refuses_a_forking_pool_on_a_one_process_store():
    from celery import Celery
    from celery.exceptions import WorkerShutdown

    from durable_celery import Durable

    memory = Durable(Celery("one_process", broker="memory://"), f"memory://{uuid.uuid4().hex}", upkeep=False)
    try:
        host = _a_worker(memory, "forking@test", pool="prefork")
        step = _bootstep(memory)(host)
        step.include(host)
        with pytest.raises(WorkerShutdown):
            step.start(host)
    finally:
        memory.db.dispose()


def test_a_worker_without_a_database_url_it_can_use_exits_saying_why(capfd):
    from celery import Celery
    from celery.exceptions import WorkerShutdown

    from durable_celery import Durable

    durable = Durable(Celery("bad_url", broker="memory://"), "nonsense://x", upkeep=False)
    with pytest.raises(WorkerShutdown) as refused:
        upkeep.refuse_old_schema(durable.runtime)
    assert refused.value.args == (1,)  # the worker's exit code
    _said_once(capfd, f"durable: {durable.db.bad_url}")


@pytest.mark.parametrize("backend", ["sqlite"])  # the schema check is the same on both
def test_a_worker_on_an_old_schema_exits_naming_every_pending_revision(tmp_path, capfd, backend):
    from alembic import command
    from celery import Celery
    from celery.exceptions import WorkerShutdown

    from durable_celery import Durable
    from durable_celery.store.migrate import alembic_config
    from durable_celery.worker.app_argument import app_argument

    durable = Durable(Celery("behind", broker="memory://"), f"sqlite:///{tmp_path}/old.sqlite3", upkeep=False)
    try:
        command.upgrade(alembic_config(durable.db), "0003")
        pending = durable.pending_migrations()
        assert len(pending) >= 2
        with pytest.raises(WorkerShutdown) as refused:
            upkeep.refuse_old_schema(durable.runtime)
        assert refused.value.args == (1,)
        _said_once(
            capfd,
            f"durable: the database schema is behind this code (pending revisions: {', '.join(pending)}); "
            f"run `celery -A {app_argument()} durable migrate`, then start this worker again",
        )
    finally:
        durable.db.dispose()
