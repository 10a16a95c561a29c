"""``durable doctor`` and ``durable status`` on stuck state made for real, and ``--fix``; a queue
no worker consumes (``no_consumer``) on each of BROKERS (Redis, RabbitMQ)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import insert, update

from durable_celery.store import event_rows, queries
from durable_celery.store.db import utcnow
from durable_celery.store.schema import nodes, runs, schedules
from durable_celery.testing import wait_for, worker
from tests.conftest import BROKERS

pytestmark = pytest.mark.timeout(120)
postgres_only = pytest.mark.parametrize("backend", ["postgres"])  # the CLI and Redis

ROOT = Path(__file__).resolve().parents[3]

# The workflows, defined alike in the test and in the app the CLI loads (its relay sends them).
DEFINE = """
from durable_celery import current_run

def define(durable):
    sleeper = durable.workflow("sleeper")
    sleeper.step(lambda: current_run().sleep(3600), name="nap")
    approval = durable.workflow("approval")
    approval.step(lambda: current_run().wait_for_event("approved"), name="approve")
    for name in ("lost", "refund", "unsent"):
        durable.workflow(name).step(lambda: "done", name="work")
"""


def define(durable):
    namespace: dict = {}
    exec(DEFINE, namespace)
    namespace["define"](durable)


def an_hour_ago():
    return utcnow() - timedelta(hours=1)


def make_stuck_state(durable):
    """Each kind of stuck state doctor knows, made the way it happens; returns the run ids."""
    sleeper, approval = durable.start("sleeper"), durable.start("approval")
    with worker(durable):
        wait_for(durable, sleeper, statuses=("waiting",))
        wait_for(durable, approval, statuses=("waiting",))
    db = durable.db
    with db.begin() as conn:
        # The sleep's timer was lost (e.g. a bad manual update): nothing makes it due again.
        conn.execute(update(runs).where(runs.c.id == sleeper).values(due_at=None, wait_until=None))
        # The event came, but its wake-up was lost.
        event_rows.insert_event_txn(db, conn, approval, "approved", "yes")
    lost, refund, unsent = durable.start("lost"), durable.start("refund"), durable.start("unsent")
    with db.single() as conn:  # a worker claimed the run, then vanished an hour ago
        assert queries.claim_run(db, conn, lost, 0, "ghost-node:1") is not None
    with db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == lost).values(heartbeat_at=an_hour_ago()))
        conn.execute(
            update(runs)
            .where(runs.c.id == refund)
            .values(status="compensating", due_at=None, published=False)
        )
        conn.execute(
            update(runs)
            .where(runs.c.id == unsent)
            .values(published=False, due_at=an_hour_ago(), created_at=an_hour_ago())
        )
        conn.execute(
            insert(schedules).values(
                name="nightly-refunds",
                workflow="refund",
                schedule="0 3 * * *",
                enabled=False,
                failures=5,
                last_outcome="error",
                created_at=utcnow(),
                updated_at=utcnow(),
            )
        )
        conn.execute(
            insert(nodes).values(
                name="celery@box1", queues=["default"], pid=4242, started_at=utcnow(), seen_at=utcnow()
            )
        )
    return {"sleeper": sleeper, "approval": approval, "lost": lost, "refund": refund, "unsent": unsent}


@pytest.fixture
def cli(durable, tmp_path):
    queue = durable.app.conf.task_default_queue
    (tmp_path / "doctorapp.py").write_text(
        DEFINE
        + textwrap.dedent(f"""
        from celery import Celery
        from durable_celery import Durable
        app = Celery("doctorapp", broker={durable.app.conf.broker_url!r})
        app.conf.task_default_queue = {queue!r}
        durable = Durable(app, {durable.db.url!r}, upkeep=False)
        define(durable)
    """)
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "doctorapp", "durable", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    return run


def test_doctor_finds_each_kind_of_stuck_state(durable):
    define(durable)
    assert durable.doctor() == []
    ids = make_stuck_state(durable)
    found = {(f.kind, f.run_id or f.details.get("schedule")): f for f in durable.doctor()}
    assert set(found) == {
        ("waiting_unwakeable", ids["sleeper"]),
        ("missed_wakeup", ids["approval"]),
        ("stale_lock", ids["lost"]),
        ("stalled_compensation", ids["refund"]),
        ("unsent", ids["unsent"]),
        ("disabled_schedule", "nightly-refunds"),
        ("no_consumer", None),  # the test's worker has stopped: the unsent run has nobody
    }
    assert found["no_consumer", None].details == {
        "queue": durable.app.conf.task_default_queue,
        "ready": 1,
        "oldest_ready_at": found["no_consumer", None].details["oldest_ready_at"],
    }
    fixable = {kind for kind, _ in found if found[kind, _].fixable}
    assert fixable == {"missed_wakeup", "stale_lock", "unsent"}
    stale = found["stale_lock", ids["lost"]]
    assert stale.workflow == "lost" and stale.details["locked_by"] == "ghost-node:1"
    assert "ghost-node:1" in stale.message and not stale.fixed
    assert found["disabled_schedule", "nightly-refunds"].workflow == "refund"


@postgres_only
def test_cli_doctor_reports_then_fixes_and_the_runs_finish(durable, cli):
    define(durable)
    ids = make_stuck_state(durable)

    status = cli("status")
    assert status.returncode == 0, status.stderr
    assert "ready: 1   oldest ready: 60m   stale locks: 1   disabled schedules: 1" in status.stdout
    assert "compensating 1" in status.stdout and "waiting 2" in status.stdout
    assert "node celery@box1  up  queues default" in status.stdout
    info = json.loads(cli("status", "--json").stdout)
    assert info["ready"] == 1 and info["runs"]["running"] == 1 and info["oldest_ready_seconds"] >= 3590

    report = cli("doctor", "--json")
    assert report.returncode == 1, report.stderr
    kinds = sorted(json.loads(line)["kind"] for line in report.stdout.splitlines())
    assert kinds == sorted(
        [
            "waiting_unwakeable",
            "missed_wakeup",
            "stale_lock",
            "stalled_compensation",
            "unsent",
            "disabled_schedule",
            "no_consumer",
        ]
    )
    text = cli("doctor")
    assert text.returncode == 1 and "7 finding(s)" in text.stdout
    assert text.stdout.count("[fixable with --fix]") == 3

    fixed = cli("doctor", "--fix")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert fixed.stdout.count("[fixed]") == 3 and "7 finding(s), 3 fixed" in fixed.stdout
    # What --fix handed back, woke and sent is done by an ordinary worker.
    with worker(durable):
        assert wait_for(durable, ids["lost"]).output == "done"
        assert wait_for(durable, ids["approval"]).output == "yes"
        assert wait_for(durable, ids["unsent"]).output == "done"
    left = {f.kind for f in durable.doctor()}
    assert left == {"waiting_unwakeable", "stalled_compensation", "disabled_schedule"}
    still = cli("doctor", "--fix")
    assert still.returncode == 0 and "3 finding(s), 0 fixed" in still.stdout


def test_doctor_knows_a_parent_waiting_for_children(durable):
    child = durable.workflow("slow_child")
    child.step(lambda: current_run_wait("go"), name="hold")
    parent = durable.workflow("waiting_parent")
    parent.step(lambda: __import__("durable_celery").current_run().call_workflow("slow_child"), name="call")
    with worker(durable):
        parent_id = durable.start(parent)
        wait_for(durable, parent_id, statuses=("waiting",))
        (kid,) = durable.list_children(parent_id)
        wait_for(durable, kid.id, statuses=("waiting",))
        # A parent that parks while its child's row is locked (the child being claimed) is made
        # due at once and parks again: wait until it is parked for good before the worker stops.
        _until_parked(durable, parent_id)
    assert durable.doctor() == []  # waiting for a child that is still going: nothing wrong
    with durable.db.begin() as conn:  # the child finished, but the parent's wake-up was lost
        conn.execute(update(runs).where(runs.c.id == kid.id).values(status="completed", finished_at=utcnow()))
    (finding,) = durable.doctor()
    assert (finding.kind, finding.run_id) == ("missed_wakeup", parent_id)
    assert [f.fixed for f in durable.doctor(fix=True)] == [True]
    assert durable.get_run(parent_id).status == "waiting"
    # Woken, it is ready on a queue no worker consumes now: that is all that is left.
    assert [f.kind for f in durable.doctor()] == ["no_consumer"]


def _until_parked(durable, run_id, seconds=20.0):
    """Poll until the run is waiting with no due time (parked, nothing to do until woken)."""
    from sqlalchemy import select

    deadline = time.monotonic() + seconds
    while True:
        with durable.db.engine.connect() as conn:
            row = conn.execute(select(runs.c.status, runs.c.due_at).where(runs.c.id == run_id)).one()
        if row.status == "waiting" and row.due_at is None:
            return
        assert time.monotonic() < deadline, f"run {run_id} is {row.status}, due {row.due_at}"
        time.sleep(0.05)


def current_run_wait(name):
    from durable_celery import current_run

    return current_run().wait_for_event(name)


def define_run_again(durable, entered, release):
    """A keyed workflow that runs again behind its holder; ``v == 1`` blocks until released."""
    wf = durable.workflow("rebuild", on_duplicate="run_again")

    @wf.step
    def rebuild(v):
        if v == 1:
            entered.set()
            release.wait(30)
        return v

    return wf


def test_doctor_leaves_a_run_again_run_waiting_behind_its_holder(durable):
    entered, release = threading.Event(), threading.Event()
    wf = define_run_again(durable, entered, release)
    with worker(durable):
        try:
            holder = durable.start(wf, {"v": 1}, key="idx")
            assert entered.wait(20)
            waiting = durable.start(wf, {"v": 2}, key="idx")
            run = durable.get_run(waiting)
            assert (run.status, run.runs_after_id) == ("waiting", holder)
            assert durable.doctor() == []  # it waits for a holder that is still going
        finally:
            release.set()
        assert wait_for(durable, holder).output == 1
        assert wait_for(durable, waiting).output == 2
    assert durable.doctor() == []


def test_doctor_finds_a_run_again_run_whose_holder_ended_without_handing_it_the_key(durable):
    wf = define_run_again(durable, threading.Event(), threading.Event())
    holder = durable.start(wf, {"v": 1}, key="idx")
    db = durable.db
    with db.single() as conn:  # a worker claimed the holder
        assert queries.claim_run(db, conn, holder, 0, "node:1") is not None
    waiting = durable.start(wf, {"v": 2}, key="idx")
    assert durable.get_run(waiting).runs_after_id == holder
    assert durable.doctor() == []
    with db.begin() as conn:  # the holder ended, but the hand-off to the waiting run was lost
        conn.execute(
            update(runs)
            .where(runs.c.id == holder)
            .values(status="completed", locked_by=None, finished_at=utcnow())
        )
    (finding,) = durable.doctor()
    assert (finding.kind, finding.run_id) == ("waiting_unwakeable", waiting)


@pytest.mark.parametrize("backend", BROKERS)
def test_ready_runs_on_a_queue_no_worker_consumes_are_a_finding(durable, cli):
    slow = f"slow-{uuid.uuid4().hex[:6]}"
    wf = durable.workflow("report")
    wf.step(lambda: "ok", name="build", queue=slow)
    fast = durable.workflow("ping")
    fast.step(lambda: "pong", name="pong")
    with worker(durable):  # consumes the default queue only, as a worker started without -Q slow
        run_id = durable.start(wf)
        assert wait_for(durable, durable.start(fast)).output == "pong"  # the node is up and working
        (finding,) = [f for f in durable.doctor() if f.kind == "no_consumer"]
        assert finding.details["queue"] == slow and finding.details["ready"] == 1
        assert slow in finding.message and not finding.fixable
        report = cli("doctor")
        assert report.returncode == 1 and f"queue '{slow}'" in report.stdout
        status = cli("status")
        assert f"no consumer: queue {slow} has 1 ready run(s)" in status.stdout
        assert json.loads(cli("status", "--json").stdout)["no_consumer"] == {slow: 1}
        durable.pause_queue(slow)  # a paused queue waits on purpose: not a finding
        assert [f for f in durable.doctor() if f.kind == "no_consumer"] == []
        durable.resume_queue(slow)
    with worker(durable, queues=[slow]):
        assert wait_for(durable, run_id).output == "ok"
    assert durable.get_run(run_id).status == "completed"
