"""Flow control per key (issue 32) with real `celery worker` processes, prefork and threads, on
one PostgreSQL database and one Redis queue: the peak of steps at once per key under load, start
order, other keys never held back, a killed worker's slot coming back, throttle spacing across
processes, and the rate limit raced from many processes. Every time compared comes from the
database (step rows, run rows, activity); the workflows are in tests/e2e/flow_app.py.
PostgreSQL and Redis; fails (never skips) without them."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import redis
from sqlalchemy import func, select

from durable_celery import Durable
from durable_celery.models import Run
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for
from tests.conftest import REDIS_URL
from tests.e2e import flow_app
from tests.e2e.support import until

ROOT = Path(__file__).resolve().parents[2]


class Workers:
    """The `celery -A tests.e2e.flow_app worker` processes of one test, each the leader of a
    process group of its own (its pool processes with it), stopped at the end."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.env, self.folder = env, folder
        self.started: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, pool: str, concurrency: int, **env: str) -> subprocess.Popen[bytes]:
        """Start a worker named ``name`` on the test's queue."""
        cmd = [sys.executable, "-m", "celery", "-A", "tests.e2e.flow_app", "worker", "-P", pool]
        cmd += ["-c", str(concurrency), "-n", f"{name}@%h", "-Q", self.env["FLOW_QUEUE"]]
        cmd += ["--loglevel", "INFO", "--without-mingle", "--without-gossip"]
        with (self.folder / f"{name}.log").open("w") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**self.env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started[name] = proc
        return proc

    def wait_ready(self, *names: str) -> None:
        """Wait until each of these workers says it is ready (consuming)."""

        def ready() -> bool:
            for name in names:
                assert self.started[name].poll() is None, f"worker {name} exited\n{self.logs()}"
            return all(" ready." in self.log(name) for name in names)

        until(ready, 60, f"workers {names} to be ready", self.logs)

    def kill(self, name: str) -> None:
        """SIGKILL the worker and its pool processes at once, and reap it."""
        proc = self.started[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def log(self, name: str) -> str:
        """What the worker wrote so far."""
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        """The tail of every worker's log, for a failure message."""
        return "\n".join(f"--- {name}\n{self.log(name)[-3000:]}" for name in self.started)

    def stop(self) -> None:
        """A warm shutdown for each worker still running; the group killed if it lingers."""
        live = [proc for proc in self.started.values() if proc.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group's leftovers, if any
            proc.wait(10)


@dataclass
class Flow:
    """A test's producer (a Durable without upkeep on the workers' database and queue), its
    workers, and its Redis queue."""

    durable: Durable
    workers: Workers
    queue: str
    db: str
    redis: redis.Redis


@pytest.fixture
def flow(pg_url: str, redis_client: redis.Redis, tmp_path: Path) -> Iterator[Flow]:
    """A fresh database, a queue and Redis keys of this test's own; the workers it starts are
    stopped and its Redis keys (queue, gates) deleted at the end."""
    queue = f"flow-{uuid.uuid4().hex[:10]}"
    base = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    env = {
        **base,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "FLOW_BROKER": REDIS_URL,
        "FLOW_QUEUE": queue,
        "FLOW_DB": pg_url,
    }
    workers = Workers(env, tmp_path)
    durable = flow_app.build(REDIS_URL, queue, pg_url, upkeep=False)
    try:
        yield Flow(durable, workers, queue, pg_url, redis_client)
    finally:
        workers.stop()
        durable.db.dispose()
        for key in redis_client.scan_iter(match=f"{queue}*"):
            redis_client.delete(key)


# -- reading what happened ----------------------------------------------------------------------


def finished_runs(durable: Durable, workflow: str, count: int) -> list[Run] | None:
    """The workflow's runs once all ``count`` of them have finished, else None."""
    found = durable.list_runs(workflow=workflow, limit=count + 10)
    assert len(found) == count, f"{len(found)} runs of {workflow}, not {count}"
    return found if all(run.finished for run in found) else None


def flow_waits(durable: Durable, ids: Iterable[str]) -> dict[str, str | None]:
    """runs.flow_wait of these runs: what each is parked for ('slot', 'throttle'), or None."""
    query = select(runs.c.id, runs.c.flow_wait).where(runs.c.id.in_(list(ids)))
    with durable.db.engine.connect() as conn:
        return {row.id: row.flow_wait for row in conn.execute(query)}


def peak(intervals: Iterable[tuple[datetime, datetime]]) -> int:
    """The most intervals open at one instant (one ending as another begins: not overlapping)."""
    edges = sorted((at, step) for begin, end in intervals for at, step in ((begin, 1), (end, -1)))
    open_now = most = 0
    for _, step in edges:  # at equal times -1 sorts before +1: ends first
        open_now += step
        most = max(most, open_now)
    return most


def by_start_order(found: Iterable[Run]) -> list[Run]:
    """Runs in the order they were started (created_at, then id, as the database orders them)."""
    return sorted(found, key=lambda run: (run.created_at, run.id))


def assert_nothing_lost(durable: Durable) -> None:
    """No run was lost by a worker, fenced, or handed back."""
    assert durable.activity(kinds=["stale_recovered", "worker_fenced", "handed_back"]) == []


# -- the tests ----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_under_load_from_many_processes_no_key_ever_passes_its_limit(flow: Flow) -> None:
    workers, durable = flow.workers, flow.durable
    workers.start("fork1", "prefork", 2)
    workers.start("fork2", "prefork", 2)
    workers.start("threads", "threads", 4)
    workers.wait_ready("fork1", "fork2", "threads")
    tenants = ["A"] * 30 + ["B"] * 18 + ["C"] * 12  # A is the busy one
    random.Random(32).shuffle(tenants)
    with ThreadPoolExecutor(4) as producers:  # four producer threads start them at once
        ids = list(producers.map(lambda tenant: durable.start("sync", {"tenant": tenant}), tenants))
    done = until(lambda: finished_runs(durable, "sync", len(ids)), 150, "60 runs to finish", workers.logs)
    assert {run.id for run in done} == set(ids)
    assert [run.id for run in done if run.status != "completed"] == []
    intervals: dict[str, list[tuple[datetime, datetime]]] = {}
    processes: set[str | None] = set()
    for run in done:
        steps = durable.list_steps(run.id)
        assert [(s.name, s.attempt, s.status) for s in steps] == [
            ("fetch", 1, "completed"),
            ("store", 1, "completed"),
        ], run.id
        key = f"t:{run.input['tenant']}"
        intervals.setdefault(key, []).extend((s.started_at, s.finished_at) for s in steps)
        processes.update(s.worker for s in steps)
    peaks = {key: peak(found) for key, found in intervals.items()}
    print(f"\npeak steps at once per key: {peaks}; steps ran in {len(processes)} processes")
    assert max(peaks.values()) <= 2, peaks
    assert peaks["t:A"] == 2, peaks  # the limit was used, not only kept
    assert len(processes) >= 3  # the load went through several worker processes
    parked = durable.activity(kinds=["slot_wait"], workflow="sync", limit=1000)
    assert parked and {a.details["key"] for a in parked} <= {"t:A", "t:B", "t:C"}
    assert all(a.details["limit"] == 2 and a.details["in_use"] <= 2 for a in parked)
    assert flow_waits(durable, ids) == dict.fromkeys(ids)  # nothing left parked
    assert_nothing_lost(durable)


@pytest.mark.timeout(120)
def test_with_one_slot_the_runs_of_a_key_go_through_in_start_order(flow: Flow) -> None:
    workers, durable = flow.workers, flow.durable
    workers.start("fork", "prefork", 2)
    workers.start("threads", "threads", 3)
    workers.wait_ready("fork", "threads")
    ids = [durable.start("line", {"tenant": "solo", "n": n}) for n in range(12)]
    done = by_start_order(until(lambda: finished_runs(durable, "line", 12), 90, "12 runs", workers.logs))
    assert [run.id for run in done] == ids and {run.status for run in done} == {"completed"}
    steps = [(run.id, s) for run in done for s in durable.list_steps(run.id)]
    first_begins = [s.started_at for _, s in steps if s.name == "first"]
    assert first_begins == sorted(first_begins)  # first steps began in start order
    # One slot: each run's two steps ran before the next run's first began, one step at a time.
    by_begin = sorted(steps, key=lambda pair: pair[1].started_at)
    assert [(run_id, s.name) for run_id, s in by_begin] == [(i, n) for i in ids for n in ("first", "second")]
    assert peak((s.started_at, s.finished_at) for _, s in steps) == 1
    assert len({s.worker for _, s in steps}) >= 2  # several processes took part
    assert_nothing_lost(durable)


@pytest.mark.timeout(120)
def test_a_key_whose_slot_is_held_holds_back_no_other_key(flow: Flow) -> None:
    workers, durable = flow.workers, flow.durable
    workers.start("threads", "threads", 4)
    workers.start("fork", "prefork", 2)
    workers.wait_ready("threads", "fork")
    busy = [durable.start("hold", {"tenant": "busy", "n": 0, "block": True})]
    until(lambda: durable.get_run(busy[0]).status == "running", 30, "the busy step to run", workers.logs)
    busy += [durable.start("hold", {"tenant": "busy", "n": n, "block": True}) for n in (1, 2)]
    parked = {run_id: "slot" for run_id in busy[1:]}
    until(lambda: flow_waits(durable, busy[1:]) == parked, 30, "the busy key's runs parked", workers.logs)
    calm = durable.start("hold", {"tenant": "calm", "n": 9})
    assert wait_for(durable, calm, timeout=30).status == "completed"  # while busy's slot is held
    assert [durable.get_run(run_id).status for run_id in busy] == ["running", "pending", "pending"]
    assert flow_waits(durable, busy) == {busy[0]: None, **parked}
    (noted,) = durable.activity(kinds=["slot_wait"], run_id=busy[1])  # once, however often it looked
    assert noted.details["key"] == "busy" and noted.details["limit"] == 1 and noted.details["in_use"] == 1
    flow.redis.set(flow_app.gate_key(flow.queue, "busy"), "1")  # the busy step may finish now
    done = [wait_for(durable, run_id, timeout=30) for run_id in busy]
    assert [run.status for run in done] == ["completed"] * 3
    begins = [durable.list_steps(run_id)[0].started_at for run_id in busy]
    assert begins == sorted(begins)
    assert_nothing_lost(durable)


@pytest.mark.timeout(150)
def test_a_killed_workers_slot_comes_back_when_its_lock_goes_stale(flow: Flow) -> None:
    workers, durable = flow.workers, flow.durable
    workers.start("doomed", "prefork", 2, FLOW_STALE="2")
    workers.wait_ready("doomed")
    first = durable.start("hold", {"tenant": "k", "n": 0, "block": True})
    until(lambda: durable.get_run(first).status == "running", 30, "the first step to run", workers.logs)
    later = [durable.start("hold", {"tenant": "k", "n": n}) for n in (1, 2)]
    parked = dict.fromkeys(later, "slot")
    until(lambda: flow_waits(durable, later) == parked, 30, "the later runs parked", workers.logs)
    workers.kill("doomed")  # the worker and its pool processes: nobody records anything
    assert durable.get_run(first).status == "running"  # its lock, and so its slot, stays behind
    assert flow_waits(durable, later) == parked
    flow.redis.set(flow_app.gate_key(flow.queue, "k"), "1")  # the step finishes when run again
    rescuer = workers.start("rescuer", "threads", 2, FLOW_STALE="2")
    done = [wait_for(durable, run_id, timeout=60) for run_id in [first, *later]]
    assert [run.status for run in done] == ["completed"] * 3
    (recovered,) = durable.activity(kinds=["stale_recovered"], run_id=first)
    assert recovered.details["losses"] == 1 and not recovered.details["failed"]
    steps = [durable.list_steps(run_id) for run_id in [first, *later]]
    assert [[(s.attempt, s.status) for s in found] for found in steps] == [[(1, "completed")]] * 3
    ran_by = {str(s.worker).rsplit(":", 1)[1] for found in steps for s in found}
    assert ran_by == {str(rescuer.pid)}  # the rescuer ran every step (a threads worker: one pid)
    # The second run's step began only once the first's slot was free: after the sweep took the
    # lock back, and after the first run, ahead of it, had its step again and finished it.
    second_began = steps[1][0].started_at
    assert second_began > recovered.at
    assert second_began >= steps[0][0].finished_at
    assert steps[2][0].started_at >= steps[1][0].finished_at


@pytest.mark.timeout(120)
def test_throttle_spaces_the_begins_across_processes_and_gives_places_in_start_order(flow: Flow) -> None:
    workers, durable = flow.workers, flow.durable
    workers.start("fork", "prefork", 2)
    workers.start("threads", "threads", 2)
    workers.wait_ready("fork", "threads")
    ids = [durable.start("api", {"customer": "x", "n": n}) for n in range(8)]
    finished = until(lambda: finished_runs(durable, "api", 8), 90, "8 throttled runs", workers.logs)
    done = by_start_order(finished)
    assert [run.id for run in done] == ids and {run.status for run in done} == {"completed"}
    begins = [run.started_at for run in done if run.started_at is not None]
    assert len(begins) == len(done)
    # Places in the window go in start order: no run begins before a run started `limit` (2) or
    # more places ahead of it. Two runs free to begin in the same window begin in the order their
    # messages are handled, so begin order is start order only window by window (see the report
    # of issue 32: core/flow.py reserves places for the runs ahead, it does not wait for them).
    for i, began in enumerate(begins):
        assert all(earlier < began for earlier in begins[: max(i - 1, 0)]), (i, begins)
    period = timedelta(seconds=flow_app.THROTTLE_PERIOD)
    in_time = sorted(begins)
    spans = [in_time[i] - in_time[i - 2] for i in range(2, len(in_time))]
    print(f"\nspans of 3 consecutive begins: {[round(s.total_seconds(), 3) for s in spans]}")
    assert all(span >= period for span in spans), spans  # any 3 consecutive begins span the period
    throttled = durable.activity(kinds=["throttled"], workflow="api", limit=100)
    assert {a.run_id for a in throttled} >= set(ids[2:])  # each waiting run noted once
    assert len(throttled) == len({a.run_id for a in throttled})
    assert all(a.details["key"] == "c:x" and a.details["limit"] == 2 for a in throttled)
    assert all(a.details["period"] == flow_app.THROTTLE_PERIOD and a.details["until"] for a in throttled)
    assert_nothing_lost(durable)


@pytest.mark.timeout(120)
def test_rate_limit_raced_from_many_processes_accepts_exactly_the_limit(flow: Flow) -> None:
    durable = flow.durable
    spawn = multiprocessing.get_context("spawn")  # fresh interpreters: no engine or socket inherited
    processes, threads = 8, 3
    barrier, results = spawn.Barrier(processes), spawn.Queue()
    racers = [
        spawn.Process(
            target=flow_app.race_starts,
            args=(REDIS_URL, flow.queue, flow.db, "u1", threads, barrier, results),
        )
        for _ in range(processes)
    ]
    for racer in racers:
        racer.start()
    try:
        answers = [results.get(timeout=90) for _ in racers]
    finally:
        for racer in racers:
            racer.join(30)
            if racer.is_alive():
                racer.kill()
    accepted = [run_id for ids, _, _ in answers for run_id in ids]
    refused = [after for _, retry_afters, _ in answers for after in retry_afters]
    assert [error for _, _, errors in answers for error in errors] == []
    assert len(accepted) == flow_app.RATE_LIMIT and len(set(accepted)) == flow_app.RATE_LIMIT
    assert len(refused) == processes * threads - flow_app.RATE_LIMIT
    assert all(0 < after <= 3600 for after in refused)
    with durable.db.engine.connect() as conn:  # the refusals wrote nothing
        count = select(func.count()).where(runs.c.workflow == "remind")
        assert conn.execute(count).scalar_one() == flow_app.RATE_LIMIT
    assert {run.id for run in durable.list_runs(workflow="remind")} == set(accepted)
    assert durable.start("remind", {"user": "u2"})  # another key has a budget of its own
