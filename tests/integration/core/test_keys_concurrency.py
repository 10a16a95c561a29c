"""Workflow keys under concurrency, on PostgreSQL + Redis: racing starts and cancels, a real
worker finishing runs meanwhile, and producers in other processes.

After every racing phase the database is read in one REPEATABLE READ snapshot and checked:
one key row per (workflow, key), every unfinished keyed run is its key's holder or the run
waiting behind it, a waiting run waits behind the current holder (and the holder is unfinished),
and no unfinished run carries a key that has no key row.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import queue as queue_module
import random
import re
import threading
import time
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from sqlalchemy import event

from durable_celery import Durable, KeyContended, KeyTaken, current_run
from durable_celery.store.schema import FINISHED, UNFINISHED
from durable_celery.testing import worker
from tests.conftest import FAST, REDIS_URL

WORKFLOW = "keyed_job"
KEYS = ("alpha", "beta", "gamma")
POLICIES = ("use_existing", "error", "cancel_existing", "run_again")
STEP_PAUSE = 0.004  # seconds each step takes
THREADS = 16


# -- helpers the spawned children import too ---------------------------------------------------


class Executions:
    """Every step execution seen in this process: (key, run id, seq, began, ended), monotonic."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: list[tuple[str, str, int, float, float]] = []

    def add(self, row: tuple[str, str, int, float, float]) -> None:
        with self._lock:
            self._rows.append(row)

    def rows(self) -> list[tuple[str, str, int, float, float]]:
        with self._lock:
            return list(self._rows)


def make(url: str, queue: str, **settings: Any) -> Durable:
    """A Celery app on the test Redis and its Durable on ``url``, with the workflow defined."""
    app = Celery("keys-concurrency", broker=REDIS_URL)
    app.conf.task_default_queue = queue
    app.conf.broker_connection_retry_on_startup = True
    # A short relay_after: a message lost to someone else's FLUSHDB is sent again soon.
    return Durable(app, url, **{**FAST, "relay_after": 5.0, **settings})


def define(durable: Durable, executions: Executions | None = None, pause: float = STEP_PAUSE) -> None:
    """One workflow with one step that records when it ran and returns its input."""
    wf = durable.workflow(WORKFLOW)

    @wf.step
    def work(seq: int) -> int:
        run = current_run()
        began = time.monotonic()
        time.sleep(pause)
        if executions is not None:
            executions.add((run.key or "", run.id, seq, began, time.monotonic()))
        return seq


def start_from_child(url: str, queue: str, barrier: Any, results: Any, starts: int, seed: int) -> None:
    """In a spawned process: build a Durable, wait for the others, then race keyed starts."""
    try:
        durable = make(url, queue, pool_size=2, upkeep=False)
        define(durable)
        order = [KEYS[i % len(KEYS)] for i in range(starts)]
        random.Random(seed).shuffle(order)
        barrier.wait(timeout=60)
        got = [(key, durable.start(WORKFLOW, {"seq": seed}, key=key)) for key in order]
        durable.db.dispose()
        results.put((os.getpid(), got, None))
    except BaseException as exc:  # report everything to the parent, which fails the test
        results.put((os.getpid(), [], repr(exc)))


# -- reading and checking the database -------------------------------------------------------


@dataclass
class State:
    """Key rows and runs, read in one snapshot."""

    keys: list[tuple[str, str, str, str | None]]
    # id -> (workflow, key, status, runs_after_id, output)
    runs: dict[str, tuple[str, str | None, str, str | None, Any]]

    def unfinished(self) -> list[tuple[str, str]]:
        return [(run_id, r[2]) for run_id, r in self.runs.items() if r[2] in UNFINISHED]

    def with_status(self, status: str) -> set[str]:
        return {run_id for run_id, r in self.runs.items() if r[2] == status}


def connect(url: str) -> psycopg.Connection[Any]:
    """A connection of the checks' own, reading in REPEATABLE READ snapshots."""
    conn = psycopg.connect(url, autocommit=True)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    return conn


def read_state(pg: psycopg.Connection[Any]) -> State:
    with pg.transaction():
        keys = pg.execute("SELECT workflow, key, holder_id, waiting_id FROM durable_keys").fetchall()
        runs = pg.execute(
            "SELECT id, workflow, key, status, runs_after_id, output FROM durable_runs"
        ).fetchall()
    return State(keys=[tuple(k) for k in keys], runs={r[0]: tuple(r[1:]) for r in runs})


def key_row_problems(state: State, row: tuple[str, str, str, str | None]) -> list[str]:
    workflow, key, holder_id, waiting_id = row
    where = f"key {workflow}/{key}"
    holder = state.runs.get(holder_id)
    if holder is None:
        return [f"{where}: holder {holder_id} does not exist"]
    problems = []
    if holder[:2] != (workflow, key):
        problems.append(f"{where}: holder {holder_id} was started for {holder[:2]}")
    if waiting_id is None:
        return problems
    waiting = state.runs.get(waiting_id)
    if waiting is None or waiting[2] != "waiting":
        problems.append(f"{where}: waiting_id {waiting_id} is {waiting and waiting[2]}, not a waiting run")
    elif waiting[3] != holder_id:
        problems.append(f"{where}: run {waiting_id} runs after {waiting[3]}, not the holder {holder_id}")
    if holder[2] in FINISHED:
        problems.append(
            f"{where}: run {waiting_id} waits behind holder {holder_id}, which is already {holder[2]}"
            " (nothing will ever wake it)"
        )
    return problems


def unfinished_run_problems(state: State) -> list[str]:
    holders = {(w, k): h for w, k, h, _ in state.keys}
    waiters = {(w, k): wt for w, k, _, wt in state.keys}
    problems = []
    waiting_per_key: Counter[tuple[str, str]] = Counter()
    for run_id, (workflow, key, status, _after, _output) in state.runs.items():
        if key is None or status not in UNFINISHED:
            continue
        if (workflow, key) not in holders:
            problems.append(f"unfinished run {run_id} ({status}) has key {key!r} but there is no key row")
            continue
        if run_id not in (holders[(workflow, key)], waiters[(workflow, key)]):
            problems.append(f"unfinished run {run_id} ({status}) of key {key!r} neither holds nor waits")
        if status == "waiting":
            waiting_per_key[(workflow, key)] += 1
    problems += [f"key {wk} has {n} waiting runs" for wk, n in waiting_per_key.items() if n > 1]
    return problems


def key_problems(state: State) -> list[str]:
    """Every broken key rule in one snapshot (empty when all is well)."""
    rows = Counter((w, k) for w, k, _, _ in state.keys)
    problems = [f"key {wk} has {n} key rows" for wk, n in rows.items() if n > 1]
    for row in state.keys:
        problems += key_row_problems(state, row)
    return problems + unfinished_run_problems(state)


UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def history(pg: psycopg.Connection[Any], problems: list[str], limit: int = 4) -> str:
    """The rows and activity of the runs named in ``problems`` (and the runs they wait behind)."""
    ids = list(dict.fromkeys(UUID.findall(" ".join(problems))))
    lines, seen = [], set()
    while ids and len(seen) < limit:
        run_id = ids.pop(0)
        if run_id in seen:
            continue
        seen.add(run_id)
        row = pg.execute(
            "SELECT status, key, runs_after_id, started_at, finished_at, error->>'message'"
            " FROM durable_runs WHERE id = %s",
            (run_id,),
        ).fetchone()
        lines.append(f"run {run_id}: (status, key, runs_after, started, finished, error) = {row}")
        if row and row[2]:
            ids.insert(0, row[2])
        entries = pg.execute(
            "SELECT at, kind, run_id, details - 'input' - 'key' - 'workflow' FROM durable_activity"
            " WHERE run_id = %s OR details::text LIKE %s ORDER BY id",
            (run_id, f"%{run_id}%"),
        ).fetchall()
        lines += [f"    {at:%H:%M:%S.%f} {kind} on {on}: {details}" for at, kind, on, details in entries]
    return "\n".join(lines)


def drain(pg: psycopg.Connection[Any], timeout: float) -> State:
    """Wait until no run is unfinished; fail with what is stuck (and why) if it takes too long,
    or at once when a snapshot breaks a key rule (every commit must keep them)."""
    deadline = time.monotonic() + timeout
    while True:
        state = read_state(pg)
        left, problems = state.unfinished(), key_problems(state)
        if not left and not problems:
            return state
        if problems or time.monotonic() > deadline:
            pytest.fail(
                f"{len(left)} run(s) unfinished: {left[:8]}; key rules broken: {problems}\n"
                + history(pg, problems or [str(left)])
            )
        time.sleep(0.1)


def overlaps(executions: list[tuple[str, str, int, float, float]], runs: set[str]) -> list[str]:
    """Pairs of the given runs of one key whose steps ran at the same time."""
    spans: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for key, run_id, _seq, began, ended in executions:
        if run_id in runs:
            spans[key].append((began, ended, run_id))
    found = []
    for key, key_spans in spans.items():
        key_spans.sort()
        for (_b1, e1, first), (b2, _e2, second) in itertools.pairwise(key_spans):
            if b2 < e1:
                found.append(f"key {key}: run {second} started {e1 - b2:.4f}s before run {first} ended")
    return found


def run_threads(target: Callable[[int], None], count: int, timeout: float = 60) -> None:
    threads = [threading.Thread(target=target, args=(n,), daemon=True) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a producer thread hung"


@pytest.fixture
def queue() -> Iterator[str]:
    """A queue of this test's own on the test Redis (fails, never skips, without a server)."""
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    name = f"keys-{uuid.uuid4().hex[:8]}"
    yield name
    client.delete(name)
    client.close()


# -- a. racing starts with no worker -----------------------------------------------------------


@pytest.mark.timeout(30)
def test_racing_starts_of_few_keys_all_get_the_one_run(pg_url, queue):
    durable = make(pg_url, queue, pool_size=THREADS)
    define(durable)
    per_thread = 4  # starts of each key, per thread
    barrier = threading.Barrier(THREADS)
    got: dict[str, list[str]] = defaultdict(list)
    errors: list[str] = []
    lock = threading.Lock()

    def producer(n: int) -> None:
        order = [key for _ in range(per_thread) for key in KEYS]
        random.Random(n).shuffle(order)
        barrier.wait(timeout=10)
        for key in order:
            try:
                run_id = durable.start(WORKFLOW, {"seq": n}, key=key)
            except Exception as exc:
                errors.append(repr(exc))
                continue
            with lock:
                got[key].append(run_id)

    run_threads(producer, THREADS)
    assert errors == []
    assert {key: len(ids) for key, ids in got.items()} == {key: THREADS * per_thread for key in KEYS}
    ids = {key: set(values) for key, values in got.items()}
    assert all(len(values) == 1 for values in ids.values()), ids
    pg = connect(pg_url)
    per_key = dict(pg.execute("SELECT key, count(*) FROM durable_runs GROUP BY key").fetchall())
    assert per_key == {key: 1 for key in KEYS}
    rows = pg.execute("SELECT workflow, key, holder_id, waiting_id FROM durable_keys").fetchall()
    assert sorted(rows) == sorted((WORKFLOW, key, *ids[key], None) for key in KEYS)
    duplicates = dict(
        pg.execute(
            "SELECT key, count(*) FROM durable_activity WHERE kind = 'key_duplicate' GROUP BY key"
        ).fetchall()
    )
    assert duplicates == {key: THREADS * per_thread - 1 for key in KEYS}
    pg.close()
    durable.db.dispose()


# -- b. rounds of mixed policies and cancels, with a worker ------------------------------------


@dataclass
class Tally:
    """What the producers got, shared by their threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    returned: set[str] = field(default_factory=set)
    recent: deque[str] = field(default_factory=lambda: deque(maxlen=12))
    holders_named: set[str] = field(default_factory=set)
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def started(self, policy: str, run_id: str) -> None:
        with self.lock:
            self.returned.add(run_id)
            self.recent.append(run_id)
            self.outcomes[policy] += 1

    def note(self, outcome: str, run_id: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if run_id is not None:
                self.holders_named.add(run_id)

    def victim(self, rng: random.Random) -> str | None:
        with self.lock:
            return rng.choice(list(self.recent)) if self.recent else None

    def fail(self, what: str, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(f"{what}: {exc!r}")


def cancel_one(durable: Durable, tally: Tally, rng: random.Random) -> None:
    victim = tally.victim(rng)
    if victim is None:
        return
    try:
        tally.note("cancel" if durable.cancel(victim) else "cancel_too_late")
    except Exception as exc:
        tally.fail(f"cancel({victim})", exc)


def start_one(durable: Durable, tally: Tally, rng: random.Random, seq: int) -> None:
    policy = rng.choice(POLICIES)
    try:
        run_id = durable.start(WORKFLOW, {"seq": seq}, key=rng.choice(KEYS), on_duplicate=policy)
    except KeyTaken as exc:
        tally.note("KeyTaken", exc.holder_id)
    except KeyContended:
        tally.note("KeyContended")  # allowed by the rules: the caller may try again
    except Exception as exc:
        tally.fail(f"start({policy})", exc)
    else:
        tally.started(policy, run_id)


def racing_round(durable: Durable, tally: Tally, seqs: Iterator[int], round_no: int, ops: int) -> None:
    barrier = threading.Barrier(THREADS)

    def producer(n: int) -> None:
        rng = random.Random(1000 * round_no + n)
        barrier.wait(timeout=10)
        for _ in range(ops):
            if rng.random() < 0.12:
                cancel_one(durable, tally, rng)
            else:
                start_one(durable, tally, rng, next(seqs))

    run_threads(producer, THREADS)


def completed_step_rows(pg: psycopg.Connection[Any]) -> dict[str, int]:
    query = (
        "SELECT r.key, count(*) FROM durable_steps s JOIN durable_runs r ON r.id = s.run_id"
        " WHERE r.status = 'completed' AND s.status = 'completed' GROUP BY r.key"
    )
    return dict(pg.execute(query).fetchall())


def check_drained(pg: psycopg.Connection[Any], state: State, tally: Tally, executions: Executions) -> None:
    assert state.with_status("waiting") == set(), "a waiting run was lost"
    missing = (tally.returned | tally.holders_named) - set(state.runs)
    assert missing == set(), f"ids returned by start (or named by KeyTaken) that do not exist: {missing}"
    completed = state.with_status("completed")
    ran = executions.rows()
    ran_completed = [row for row in ran if row[1] in completed]
    times_run = Counter(row[1] for row in ran_completed)
    assert set(times_run) == completed, "a completed run whose step never ran here (or the reverse)"
    assert all(n == 1 for n in times_run.values()), "a completed run's step ran more than once"
    assert all(state.runs[run_id][4] == seq for _k, run_id, seq, _b, _e in ran_completed)
    completed_per_key = Counter(state.runs[run_id][1] for run_id in completed)
    assert completed_per_key == Counter(row[0] for row in ran_completed)
    assert completed_step_rows(pg) == dict(completed_per_key)
    assert overlaps(ran, completed) == []


@pytest.mark.timeout(90)
def test_racing_policies_and_cancels_with_a_worker_keep_the_key_rules(pg_url, queue):
    durable = make(pg_url, queue, pool_size=12)
    executions = Executions()
    define(durable, executions)
    pg = connect(pg_url)
    tally, seqs = Tally(), itertools.count(1)
    with worker(durable, concurrency=2):
        for round_no in range(5):
            racing_round(durable, tally, seqs, round_no, ops=8)
            assert tally.errors == [], tally.errors
            problems = key_problems(read_state(pg))
            assert problems == [], f"after round {round_no + 1}: {problems}\n{history(pg, problems)}"
        state = drain(pg, timeout=40)
    print(f"outcomes: {dict(tally.outcomes)}; {len(state.runs)} runs")
    assert key_problems(state) == []
    check_drained(pg, state, tally, executions)
    pg.close()
    durable.db.dispose()


# -- c. producers in other processes -------------------------------------------------------------


@pytest.mark.timeout(90)
def test_producers_in_four_processes_get_one_run_per_key(pg_url, queue):
    ctx = multiprocessing.get_context("spawn")
    processes, starts = 4, 25
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    children = [
        ctx.Process(target=start_from_child, args=(pg_url, queue, barrier, results, starts, seed))
        for seed in range(processes)
    ]
    for child in children:
        child.start()
    outcomes = []
    try:
        for _ in children:
            outcomes.append(results.get(timeout=60))
    except queue_module.Empty:
        pytest.fail(f"children did not report: exit codes {[c.exitcode for c in children]}")
    finally:
        for child in children:
            child.join(timeout=20)
            if child.is_alive():
                child.kill()
    assert [error for _pid, _got, error in outcomes if error] == []
    assert len({pid for pid, _got, _error in outcomes}) == processes
    ids: dict[str, set[str]] = defaultdict(set)
    for _pid, got, _error in outcomes:
        assert len(got) == starts
        for key, run_id in got:
            ids[key].add(run_id)
    assert sorted(ids) == sorted(KEYS) and all(len(v) == 1 for v in ids.values()), ids
    with psycopg.connect(pg_url) as pg:
        runs = pg.execute("SELECT key, id FROM durable_runs").fetchall()
        holders = pg.execute("SELECT key, holder_id FROM durable_keys").fetchall()
    assert sorted(runs) == sorted((key, *ids[key]) for key in KEYS)
    assert sorted(holders) == sorted(runs)


# -- d. a run_again storm on one key -------------------------------------------------------------


class Monitor:
    """Checks the key rules in a loop while the storm runs; at most one holder and one waiting."""

    def __init__(self, url: str) -> None:
        self.pg = connect(url)
        self.stop = threading.Event()
        self.checks = 0
        self.problems: list[str] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            state = read_state(self.pg)
            found = key_problems(state)
            if len(state.unfinished()) > 2:
                found.append(f"{len(state.unfinished())} unfinished runs: {state.unfinished()}")
            self.problems += found
            self.checks += 1
            self.stop.wait(0.005)

    def __enter__(self) -> Monitor:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        self.pg.close()


@pytest.mark.timeout(60)
def test_run_again_storm_keeps_one_holder_one_waiting_and_runs_the_newest_input(pg_url, queue):
    durable = make(pg_url, queue, pool_size=THREADS + 4)
    executions = Executions()
    define(durable, executions)
    seqs, burst, paced = itertools.count(1), 8, 12
    per_thread = burst + paced
    tally = Tally()
    barrier = threading.Barrier(THREADS)

    def producer(n: int) -> None:
        # A burst where all threads collide, then starts spread out (Poisson-like, ~100/s in all)
        # so that holders also finish with nobody waiting and a start lands on that moment.
        rng = random.Random(n)
        barrier.wait(timeout=10)
        for i in range(per_thread):
            if i >= burst:
                time.sleep(rng.uniform(0, 0.25))
            try:
                run_id = durable.start(WORKFLOW, {"seq": next(seqs)}, key="storm", on_duplicate="run_again")
            except KeyContended:
                tally.note("KeyContended")
            except Exception as exc:
                tally.fail("start(run_again)", exc)
            else:
                tally.started("run_again", run_id)

    with worker(durable, concurrency=2), Monitor(pg_url) as monitor:
        run_threads(producer, THREADS)
        newest = next(seqs)  # started after every racing start has returned
        newest_id = durable.start(WORKFLOW, {"seq": newest}, key="storm", on_duplicate="run_again")
        pg = connect(pg_url)
        state = drain(pg, timeout=30)
    assert tally.errors == [], tally.errors
    assert monitor.checks > 0 and monitor.problems == [], monitor.problems[:10]
    assert set(state.runs) >= tally.returned
    assert state.with_status("completed") == set(state.runs), "every run_again run should complete"
    newest_run = durable.get_run(newest_id)
    assert (newest_run.status, newest_run.output) == ("completed", newest), "the newest input was lost"
    assert overlaps(executions.rows(), set(state.runs)) == []
    assert Counter(row[1] for row in executions.rows()) == Counter(set(state.runs))
    print(
        f"{len(tally.returned)} ids for {THREADS * per_thread + 1} starts, {len(state.runs)} runs, "
        f"{monitor.checks} checks"
    )
    pg.close()
    durable.db.dispose()


# -- the race behind a lost waiting run, made deterministic --------------------------------------


class CommitGate:
    """Holds the commit of the armed thread's next transaction that locked a durable_keys row."""

    def __init__(self, durable: Durable) -> None:
        self.thread: int | None = None
        self.paused = threading.Event()
        self.resume = threading.Event()
        event.listen(durable.db.engine, "before_cursor_execute", self._statement)
        event.listen(durable.db.engine, "commit", self._commit)

    def arm(self) -> None:
        self.thread = threading.get_ident()

    def _statement(self, conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if threading.get_ident() == self.thread and "durable_keys" in statement and "FOR UPDATE" in statement:
            conn.info["gate_locked_key"] = True

    def _commit(self, conn: Any) -> None:
        if conn.info.pop("gate_locked_key", False):
            self.thread = None
            self.paused.set()
            self.resume.wait(10)


def wait_for_lock_wait(pg: psycopg.Connection[Any], timeout: float) -> bool:
    query = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pg.execute(query).fetchone()[0]:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ending", ["completes", "is_cancelled"])
def test_run_again_meeting_the_holders_last_commit_leaves_no_run_stranded(pg_url, queue, ending):
    # The holder's last transaction locks the key row (without changing it) and finishes the
    # run; a run_again start arriving meanwhile waits for that lock, then decides on what it
    # read before the wait. It must not leave a run waiting behind a finished holder.
    durable = make(pg_url, queue, pool_size=4)
    define(durable, pause=0)
    holder_id = durable.start(WORKFLOW, {"seq": 1}, key="k")
    gate, got = CommitGate(durable), {}

    def end_holder() -> None:
        gate.arm()
        if ending == "completes":
            durable.run_message(WORKFLOW, 0, holder_id)
        else:
            durable.cancel(holder_id)

    def start_again() -> None:
        got["id"] = durable.start(WORKFLOW, {"seq": 2}, key="k", on_duplicate="run_again")

    ender, starter = threading.Thread(target=end_holder), threading.Thread(target=start_again)
    ender.start()
    assert gate.paused.wait(10), "the holder's last transaction never came"
    starter.start()
    with psycopg.connect(pg_url, autocommit=True) as pg:
        blocked = wait_for_lock_wait(pg, 3)
    gate.resume.set()
    ender.join(10)
    starter.join(10)
    holder, new = durable.get_run(holder_id), durable.get_run(got["id"])
    assert holder.status == ("completed" if ending == "completes" else "cancelled")
    print(f"the start waited for the holder's key row lock: {blocked}")
    assert new.status != "waiting", (
        f"run {new.id} waits behind {new.runs_after_id}, which is already {holder.status}: "
        "nothing will ever start it"
    )
    assert new.status == "pending" and new.holds_key
    durable.db.dispose()
