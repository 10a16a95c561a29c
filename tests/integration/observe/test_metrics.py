"""Prometheus metrics after real runs: signal counters and database gauges, also over HTTP."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import event, insert, update

from durable_celery import Durable
from durable_celery.core.sweeps import sweep_stale_once
from durable_celery.store import queries
from durable_celery.store.db import utcnow
from durable_celery.store.schema import runs, schedules
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(90)
postgres_only = pytest.mark.parametrize("backend", ["postgres"])

ROOT = Path(__file__).resolve().parents[3]


def until(condition, timeout=20.0):
    """Poll ``condition`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def test_failed_runs_backlog_and_schedules_are_counted_and_served(make_durable):
    durable = make_durable()
    metrics = durable.metrics
    backlog = durable.workflow("backlog", queue=f"nobody-{uuid.uuid4().hex[:6]}")  # no worker takes it

    @backlog.step
    def wait_in_line():
        return None

    fails = durable.workflow("fails")

    @fails.step(retry=2)
    def boom():
        raise RuntimeError("always")

    fine = durable.workflow("fine")

    @fine.step
    def works():
        return 1

    waiting = [durable.start(backlog) for _ in range(3)]
    with durable.db.begin() as conn:  # the oldest was started ten minutes ago, and never taken
        ten_minutes_ago = utcnow() - timedelta(minutes=10)
        conn.execute(update(runs).where(runs.c.id == waiting[0]).values(created_at=ten_minutes_ago))
    assert metrics.value("durable_ready_runs", {"workflow": "backlog"}) == 3
    assert metrics.value("durable_runs", {"workflow": "backlog", "status": "pending"}) == 3
    assert metrics.value("durable_runs", {"workflow": "fails", "status": "running"}) == 0
    age = metrics.value("durable_oldest_ready_run_age_seconds", {"workflow": "backlog"})
    assert age is not None and 600 <= age < 700
    failed_id, fine_id = durable.start(fails), durable.start(fine)
    with worker(durable):
        assert wait_for(durable, failed_id).status == "failed"
        assert wait_for(durable, fine_id).status == "completed"
    assert metrics.value("durable_runs_finished_total", {"workflow": "fails", "status": "failed"}) == 1
    assert metrics.value("durable_runs_finished_total", {"workflow": "fine", "status": "completed"}) == 1
    assert (
        metrics.value(
            "durable_steps_finished_total", {"workflow": "fails", "step": "boom", "status": "failed"}
        )
        == 2
    )
    assert metrics.value("durable_runs_finished_recent", {"workflow": "fails", "status": "failed"}) == 1
    assert metrics.value("durable_ready_runs", {"workflow": "backlog"}) == 3
    assert metrics.value("durable_ready_runs", {"workflow": "fails"}) is None
    assert metrics.value("durable_schedules_disabled") == 0
    with durable.db.begin() as conn:
        conn.execute(
            insert(schedules).values(
                name="nightly",
                workflow="fine",
                schedule="0 3 * * *",
                enabled=False,
                failures=5,
                created_at=utcnow(),
                updated_at=utcnow(),
            )
        )
    assert metrics.value("durable_schedules_disabled") == 1
    assert metrics.value("durable_database_up") == 1

    server = metrics.start_http_server(0, "127.0.0.1")
    try:
        text = scrape(server.server_port)
    finally:
        server.shutdown()
    assert 'durable_ready_runs{workflow="backlog"} 3.0' in text
    assert 'durable_runs_finished_total{status="failed",workflow="fails"} 1.0' in text
    assert "durable_schedules_disabled 1.0" in text


@postgres_only
def test_stale_recoveries_fenced_workers_and_failed_acks(make_durable):
    durable = make_durable()
    metrics = durable.metrics
    lost = durable.workflow("lost", queue=f"nobody-{uuid.uuid4().hex[:6]}")

    @lost.step
    def vanished():
        return None

    taken = durable.workflow("taken")
    started = threading.Event()

    @taken.step
    def slow():
        started.set()
        for _ in range(400):  # short waits, so the fencing interrupt gets in between
            time.sleep(0.025)

    # A worker claimed a run and vanished: its heartbeat is an hour old.
    lost_id = durable.start(lost)
    with durable.db.single() as conn:
        assert queries.claim_run(durable.db, conn, lost_id, 0, "ghost-node:1") is not None
    with durable.db.begin() as conn:
        an_hour_ago = utcnow() - timedelta(hours=1)
        conn.execute(update(runs).where(runs.c.id == lost_id).values(heartbeat_at=an_hour_ago))
    assert metrics.value("durable_stale_locks") == 1
    assert sweep_stale_once(durable.runtime) == ([lost_id], [])
    assert metrics.value("durable_stale_recovered_total", {"outcome": "handed_back"}) == 1
    assert metrics.value("durable_stale_locks") == 0

    taken_id = durable.start(taken)
    with worker(durable):
        assert started.wait(20)
        # Another node takes the run over while the step still runs: the worker is fenced out.
        with durable.db.begin() as conn:
            conn.execute(
                update(runs)
                .where(runs.c.id == taken_id)
                .values(fence=runs.c.fence + 1, locked_by="other-node:1", heartbeat_at=utcnow())
            )
        until(lambda: metrics.value("durable_worker_fenced_total", {"workflow": "taken"}) == 1)
        # A step message the engine cannot handle fails the Celery task: a failed ack.
        durable.app.send_task("durable.taken.slow", kwargs={"run_id": taken_id, "unexpected": 1})
        until(lambda: metrics.value("durable_ack_failed_total", {"task": "durable.taken.slow"}) == 1)
    assert durable.get_run(taken_id).status == "running"  # still the other node's


@postgres_only
def test_cli_serves_database_gauges(make_durable, tmp_path):
    durable = make_durable()
    wf = durable.workflow("queued", queue=f"nobody-{uuid.uuid4().hex[:6]}")

    @wf.step
    def later():
        return None

    durable.start(wf)
    durable.start(wf)
    (tmp_path / "metricsapp.py").write_text(
        textwrap.dedent(f"""
        from celery import Celery
        from durable_celery import Durable
        app = Celery("metricsapp", broker="memory://")
        durable = Durable(app, {durable.db.url!r}, upkeep=False)
    """)
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    command = [sys.executable, "-m", "celery", "-A", "metricsapp", "durable", "metrics"]
    process = subprocess.Popen([*command, "--port", "0"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert "serving durable metrics on http://127.0.0.1:" in line, line  # the default address
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        text = scrape(port)
    finally:
        process.terminate()
        process.wait(10)
    assert 'durable_ready_runs{workflow="queued"} 2.0' in text
    assert "durable_database_up 1.0" in text


@postgres_only
def test_a_worker_serves_metrics_on_the_metrics_port_and_bad_ports_are_refused(make_durable):
    from prometheus_client import CollectorRegistry

    from durable_celery import InvalidDefinition

    with pytest.raises(InvalidDefinition, match="metrics_port"):
        make_durable("badport", metrics_port="9808")
    with pytest.raises(InvalidDefinition, match="metrics_addr"):
        make_durable("badaddr", metrics_port=0, metrics_addr="")
    durable = make_durable(metrics_port=0)  # 0: any free port, for the test
    wf = durable.workflow("served")

    @wf.step
    def fail():
        raise ValueError("no")

    run_id = durable.start(wf)
    with worker(durable):
        wait_for(durable, run_id)
        text = scrape(durable.metrics.server.server_port)
        assert durable.metrics.server.server_address[0] == "127.0.0.1"  # not the network, by default
    assert durable.metrics.server is None  # stopped with the worker
    assert 'durable_runs_finished_total{status="failed",workflow="served"} 1.0' in text
    mine = CollectorRegistry()
    durable.metrics.register(mine)
    assert (
        mine.get_sample_value("durable_runs_finished_total", {"workflow": "served", "status": "failed"}) == 1
    )


class StatementCount:
    """Statements sent on an engine while it listens (any thread, e.g. the HTTP server's)."""

    def __init__(self, engine):
        self.engine, self.n = engine, 0

    def __enter__(self):
        event.listen(self.engine, "before_cursor_execute", self._count)
        return self

    def __exit__(self, *_):
        event.remove(self.engine, "before_cursor_execute", self._count)

    def _count(self, *_args, **_kwargs):
        self.n += 1

    def during(self, action) -> int:
        before = self.n
        action()
        return self.n - before


@postgres_only
def test_scrapes_within_the_cache_window_run_no_sql_and_later_ones_read_again(make_durable):
    durable = make_durable()
    wf = durable.workflow("cached", queue=f"nobody-{uuid.uuid4().hex[:6]}")

    @wf.step
    def later():
        return None

    durable.start(wf)
    server = durable.metrics.start_http_server(0)
    port, texts = server.server_port, []
    try:
        with StatementCount(durable.db.engine) as statements:
            assert statements.during(lambda: texts.append(scrape(port))) == 6  # one read: six queries
            durable.start(wf)
            assert statements.during(lambda: texts.append(scrape(port))) == 0  # within 5 s: the same read
            durable.metrics.collector.cache_seconds = 0.2  # a short window, instead of a long sleep
            time.sleep(0.3)
            assert statements.during(lambda: texts.append(scrape(port))) == 6
    finally:
        server.shutdown()
    assert ['durable_ready_runs{workflow="cached"} 1.0' in t for t in texts] == [True, True, False]
    assert 'durable_ready_runs{workflow="cached"} 2.0' in texts[2]
    assert durable.metrics.value("durable_ready_runs", {"workflow": "cached"}) == 2  # value() reads afresh


def _refused(addr: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(5)
        return sock.connect_ex((addr, port)) != 0


@postgres_only
def test_endpoints_listen_on_127_0_0_1_unless_metrics_addr_opens_them(make_durable):
    # On Linux all of 127/8 is this machine: a server on 0.0.0.0 would answer 127.0.0.2 too.
    server = make_durable().metrics.start_http_server(0)
    try:
        assert server.socket.getsockname()[0] == "127.0.0.1"
        assert not _refused("127.0.0.1", server.server_port)
        assert _refused("127.0.0.2", server.server_port)
    finally:
        server.shutdown()
    server = make_durable("elsewhere", metrics_addr="127.0.0.2").metrics.start_http_server(0)
    try:
        assert server.socket.getsockname()[0] == "127.0.0.2"
        assert not _refused("127.0.0.2", server.server_port)
        assert _refused("127.0.0.1", server.server_port)
    finally:
        server.shutdown()


def test_an_unreachable_database_reads_as_down_and_is_logged_once_per_outage(caplog):
    app = Celery("down", broker="memory://")
    durable = Durable(app, "postgresql://postgres@127.0.0.1:1/nothing_listens", upkeep=False)
    durable.metrics.collector.cache_seconds = 0  # every scrape tries the database
    with caplog.at_level(logging.ERROR, logger="durable_celery"):
        for _ in range(3):
            exposition = durable.metrics.exposition().decode()
            assert "durable_database_up 0.0" in exposition
            assert "durable_ready_runs" not in exposition
    assert [r.message for r in caplog.records].count("durable metrics: reading the database failed") == 1
    durable.db.dispose()


@postgres_only
def test_pool_waits_are_a_histogram_and_a_starved_pool_shows_in_it(make_durable):
    durable = make_durable(pool_size=1)  # one connection, plus one overflow
    metrics = durable.metrics
    durable.count_runs()
    assert metrics.value("durable_db_pool_wait_seconds_count") >= 1
    assert metrics.value("durable_db_pool_wait_seconds_bucket", {"le": "0.25"}) >= 1
    # Both connections held for 0.3 s: a third statement waits for one to come back.
    held = threading.Barrier(3)

    def hold() -> None:
        with durable.db.engine.connect():
            held.wait()
            time.sleep(0.3)

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for thread in holders:
        thread.start()
    held.wait()
    before = metrics.value("durable_db_pool_wait_seconds_sum") or 0.0
    durable.count_runs()
    waited = (metrics.value("durable_db_pool_wait_seconds_sum") or 0.0) - before
    for thread in holders:
        thread.join()
    assert 0.2 < waited < 5.0
    assert "durable_db_pool_wait_seconds_bucket" in metrics.exposition().decode()


@postgres_only
def test_draining_nodes_are_a_gauge(make_durable):
    """A node in a graceful shutdown counts in durable_nodes_draining while it is seen."""
    from durable_celery.store import node_rows

    durable = make_durable()
    metrics = durable.metrics
    with durable.db.begin() as conn:
        for name in ("a@host", "b@host"):
            node_rows.register_node_txn(durable.db, conn, name, ["celery"], 1, {})
    assert metrics.value("durable_nodes_draining") == 0
    with durable.db.begin() as conn:
        assert node_rows.mark_draining(conn, "a@host")
    metrics.collector.invalidate()
    assert metrics.value("durable_nodes_draining") == 1
