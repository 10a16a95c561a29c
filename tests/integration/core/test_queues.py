"""Queues: pause and resume on every worker, the claim-time check, queue stats, nodes, samples.
Pause and resume with workers also run on RabbitMQ (BROKERS)."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from durable_celery import current_run
from durable_celery.core import queues as queues_module
from durable_celery.errors import InvalidArgument
from durable_celery.store import node_rows
from durable_celery.store.db import utcnow
from durable_celery.store.schema import queue_samples, runs
from durable_celery.testing import wait_for, worker
from tests.conftest import BROKERS, BROKERS_AND_SQLITE
from tests.integration.helpers import drop_messages

pytestmark = pytest.mark.timeout(120)


def until(condition, timeout=20.0, what="condition"):
    """Poll ``condition`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.05)


def define(durable, queue, ran):
    """A two-step workflow: the first step on ``queue``, the second on the default queue."""
    wf = durable.workflow("routed")

    @wf.step(queue=queue)
    def on_queue(n=0):
        ran.append((durable.app.main, current_run().id))

    @wf.step
    def after(n=0):
        return n

    return wf


def node_queues(durable):
    return {n["name"]: n["queues"] for n in durable.list_nodes()}


@pytest.mark.parametrize("backend", BROKERS)
def test_pause_and_resume_apply_on_two_workers(make_durable):
    queue = f"slow-{uuid.uuid4().hex[:6]}"
    ran = []
    first, second = make_durable("node_a"), make_durable("node_b")
    define(first, queue, ran)
    wf_b = define(second, queue, ran)
    for d in (first, second):
        d.workflow("unrouted").step(lambda: "ok", name="plain")
    default = first.app.conf.task_default_queue
    first.pause_queue(queue)
    early = [first.start("routed", {"n": i}) for i in range(3)]
    with (
        worker(first, queues=[queue, default], hostname=f"a-{queue}@test"),
        worker(second, queues=[queue, default], hostname=f"b-{queue}@test"),
    ):
        # Both nodes registered and stopped consuming the paused queue.
        until(
            lambda: (
                node_queues(first).get(f"a-{queue}@test") == [default]
                and node_queues(first).get(f"b-{queue}@test") == [default]
            ),
            what="both nodes reconciled",
        )
        late = [second.start(wf_b, {"n": i}) for i in range(3, 5)]
        # A message that reaches a worker anyway is refused at the claim and left ready.
        assert second.run_message("routed", 0, late[0]) == "dropped"
        # The default queue still works on both nodes meanwhile.
        probes = [first.start("unrouted") for _ in range(4)]
        for run_id in probes:
            assert wait_for(first, run_id).status == "completed"
        assert ran == []
        stats = first.stats.queues()[queue]
        assert stats["paused"] is True and stats["ready"] == 5 and stats["running"] == 0
        assert {first.get_run(r).status for r in early + late} == {"pending"}

        assert first.resume_queue(queue) == 5
        for run_id in early + late:
            assert wait_for(first, run_id).status == "completed"
        until(
            lambda: all(
                sorted(node_queues(first).get(f"{n}-{queue}@test", [])) == sorted([queue, default])
                for n in "ab"
            ),
            what="both nodes consume the queue again",
        )
    assert sorted(r for _, r in ran) == sorted(early + late)
    assert first.stats.queues()[queue]["paused"] is False
    kinds = [e.kind for e in first.activity(kinds=["queue_paused", "queue_resumed"])]
    assert kinds == ["queue_resumed", "queue_paused"]


@pytest.mark.parametrize("backend", BROKERS_AND_SQLITE)
def test_pause_holds_the_next_step_of_a_run_already_going(make_durable):
    durable = make_durable()
    queue = f"late-{uuid.uuid4().hex[:6]}"
    wf = durable.workflow("two_queues")
    release = threading.Event()

    @wf.step
    def first():
        release.wait(10)

    @wf.step(queue=queue)
    def second():
        return "second"

    default = durable.app.conf.task_default_queue
    run_id = durable.start(wf)
    with worker(durable, queues=[default, queue]):
        until(lambda: durable.stats.queues()[default]["running"] == 1, what="first step running")
        durable.pause_queue(queue)
        release.set()
        until(lambda: durable.stats.queues()[queue]["ready"] == 1, what="second step ready")
        assert durable.get_run(run_id).status == "running"
        assert durable.run_message("two_queues", 1, run_id) == "dropped"
        durable.resume_queue(queue)
        assert wait_for(durable, run_id).output == "second"


def test_stats_queues_counts_ready_running_and_waiting(make_durable):
    durable = make_durable()
    default = durable.app.conf.task_default_queue
    busy_queue, idle_queue = f"busy-{uuid.uuid4().hex[:6]}", f"idle-{uuid.uuid4().hex[:6]}"
    release = threading.Event()
    started = threading.Event()
    slow = durable.workflow("slow", queue=busy_queue)

    @slow.step
    def hold():
        started.set()
        release.wait(20)

    sleeper = durable.workflow("sleeper", queue=busy_queue)

    @sleeper.step
    def nap():
        current_run().sleep(3600)

    idle = durable.workflow("idle", queue=idle_queue)
    idle.step(lambda: None, name="nothing")

    stats = durable.stats.queues()
    assert stats[idle_queue] == {
        "ready": 0,
        "running": 0,
        "waiting": 0,
        "oldest_ready_at": None,
        "paused": False,
    }
    assert stats[busy_queue]["ready"] == 0 and default in stats

    before = utcnow()
    ready = [durable.start(idle) for _ in range(3)]
    holding = durable.start(slow)
    napping = durable.start(sleeper)
    with worker(durable, queues=[busy_queue]):
        assert started.wait(20)
        wait_for(durable, napping, statuses=("waiting",))
        stats = durable.stats.queues()
        assert stats[busy_queue] == {
            "ready": 0,
            "running": 1,
            "waiting": 1,
            "oldest_ready_at": None,
            "paused": False,
        }
        assert stats[idle_queue]["ready"] == 3 and stats[idle_queue]["running"] == 0
        oldest = stats[idle_queue]["oldest_ready_at"]
        assert before - timedelta(seconds=5) <= oldest <= utcnow() + timedelta(seconds=5)
        with durable.db.engine.connect() as conn:
            first_due = conn.execute(select(func.min(runs.c.due_at)).where(runs.c.id.in_(ready))).scalar()
        assert abs((oldest - first_due.replace(tzinfo=oldest.tzinfo)).total_seconds()) < 1
        release.set()
        wait_for(durable, holding)
    durable.pause_queue(idle_queue)
    assert durable.stats.queues()[idle_queue]["paused"] is True


def test_bad_queue_names_are_refused_and_write_nothing(durable):
    for bad in ("", "   ", None, 7, "x" * 201):
        with pytest.raises(InvalidArgument):
            durable.pause_queue(bad)
        with pytest.raises(InvalidArgument):
            durable.resume_queue(bad)
    assert queues_module.paused_queues(durable.db) == set()
    assert durable.activity(kinds=["queue_paused", "queue_resumed"]) == []


def test_nodes_heartbeat_drain_and_old_ones_are_forgotten(make_durable):
    durable = make_durable()
    with durable.db.begin() as conn:
        node_rows.insert_node_txn(
            conn,
            {
                "name": "gone@old",
                "queues": ["celery"],
                "pid": 1,
                "started_at": utcnow() - timedelta(days=3),
                "seen_at": utcnow() - timedelta(days=2),
            },
        )
    name = f"n-{uuid.uuid4().hex[:6]}@test"
    with worker(durable, hostname=name):
        until(lambda: name in node_queues(durable) and "gone@old" not in node_queues(durable))
        (node,) = durable.list_nodes()
        assert node["queues"] == [durable.app.conf.task_default_queue] and node["draining"] is False
        seen = node["seen_at"]
        until(lambda: durable.list_nodes()[0]["seen_at"] > seen, what="a second heartbeat")
        with durable.db.begin() as conn:
            assert node_rows.mark_draining(conn, name) is True
            assert node_rows.mark_draining(conn, "nobody@nowhere") is False
        assert durable.list_nodes()[0]["draining"] is True
        # The worker's upkeep also wrote a queue sample at its start.
        until(lambda: queues_module.list_samples(durable.db) != [], what="a queue sample")


def test_queue_samples_one_writer_at_a_time_and_trimmed(make_durable):
    durable = make_durable()
    queue = f"s-{uuid.uuid4().hex[:6]}"
    wf = durable.workflow("sampled", queue=queue)
    wf.step(lambda: None, name="nothing")
    durable.start(wf)
    with durable.db.begin() as conn:
        conn.execute(
            queue_samples.insert().values(
                queue=queue, ready=9, running=0, waiting=0, at=utcnow() - timedelta(days=8)
            )
        )
    assert queues_module.sample_once(durable.runtime, 60.0) is True
    assert queues_module.sample_once(durable.runtime, 60.0) is False  # another node's recent sample counts
    samples = queues_module.list_samples(durable.db, queue, since=utcnow() - timedelta(days=30))
    assert [(s.queue, s.ready, s.running, s.waiting) for s in samples] == [(queue, 1, 0, 0)]
    assert samples[0].oldest_ready_at is not None


@pytest.mark.parametrize("backend", ["postgres"])
def test_samples_from_many_nodes_at_once_write_one_set(make_durable):
    durables = [make_durable(f"s{i}") for i in range(4)]
    barrier = threading.Barrier(len(durables))
    results = []

    def sample(d):
        barrier.wait()
        results.append(queues_module.sample_once(d.runtime, 60.0))

    threads = [threading.Thread(target=sample, args=(d,)) for d in durables]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True]


def test_cli_queues_pause_resume_and_nodes(durable, tmp_path):
    import os
    import subprocess
    import sys
    import textwrap

    queue = f"cli-{uuid.uuid4().hex[:6]}"
    wf = durable.workflow("cli_routed", queue=queue)
    wf.step(lambda: None, name="nothing")
    run_id = durable.start(wf)
    (tmp_path / "queueapp.py").write_text(
        textwrap.dedent(f"""
        from celery import Celery
        from durable_celery import Durable
        app = Celery("queueapp", broker="memory://")
        app.conf.task_default_queue = {durable.app.conf.task_default_queue!r}
        durable = Durable(app, {durable.db.url!r}, upkeep=False)
    """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    def celery(*args, code=0):
        out = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "queueapp", "durable", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == code, out.stderr
        return out.stdout + out.stderr

    assert f"queue {queue}: paused" in celery("pause", queue)
    listing = celery("queues")
    (line,) = [line for line in listing.splitlines() if line.startswith(queue)]
    assert line.split()[1:5] == ["1", "0", "0", "yes"]
    assert "non-empty" in celery("pause", " ", code=1)
    assert f"queue {queue}: resumed, 1 ready run(s) sent again" in celery("resume", queue)
    (line,) = [line for line in celery("queues").splitlines() if line.startswith(queue)]
    assert line.split()[4] == "-"
    assert "node" in celery("nodes")
    assert durable.get_run(run_id).status == "pending"


@pytest.mark.parametrize("backend", BROKERS_AND_SQLITE)
def test_a_ready_compensation_of_a_paused_queue_is_counted_ready_and_sent_again_on_resume(make_durable):
    durable = make_durable()
    queue = f"undo-{uuid.uuid4().hex[:6]}"
    default = durable.app.conf.task_default_queue
    wf = durable.workflow("charged")
    entered, release, refunded = threading.Event(), threading.Event(), []

    @wf.step(queue=queue, compensate=lambda: refunded.append(current_run().id))
    def charge():
        return "charged"

    @wf.step
    def ship():
        entered.set()
        release.wait(20)
        raise RuntimeError("out of stock")

    name = f"c-{queue}@test"
    with worker(durable, queues=[default, queue], hostname=name):
        try:
            run_id = durable.start(wf)
            assert entered.wait(20)
            durable.pause_queue(queue)
            until(lambda: node_queues(durable).get(name) == [default], what="the node stops consuming")
        finally:
            release.set()
        wait_for(durable, run_id, statuses=("compensating",))
        # The compensation is due and nobody holds it: ready, on the paused queue of its step.
        until(lambda: durable.stats.queues()[queue]["ready"] == 1, what="the compensation ready")
        stats = durable.stats.queues()[queue]
        assert stats["waiting"] == 0 and stats["running"] == 0 and stats["oldest_ready_at"] is not None
        assert durable.status_summary()["ready_by_workflow"].get(wf.name) == 1  # the backlog too
        # Its message is gone, as when a worker took it during the pause and dropped it.
        drop_messages(durable.app, queue)
        assert durable.get_run(run_id).status == "compensating" and refunded == []
        assert durable.resume_queue(queue) == 1
        # Sent again at the relay's next pass, not after relay_after (30s here).
        assert wait_for(durable, run_id, timeout=15).status == "compensated"
    assert refunded == [run_id]
