"""Fair share across fair keys and priorities in a limit's line (core/flow.py): a run's place is
``line_at``, set at its start, and the claim and wake-up statements of flow control order by it;
on PostgreSQL, the SQLite file and the in-memory store."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from sqlalchemy import func, select

from durable_celery import InvalidDefinition, InvalidStart
from durable_celery.core import flow
from durable_celery.store.schema import runs
from durable_celery.testing import RecordingOutbox, wait_for, worker
from tests.conftest import EVERY_STORE

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=EVERY_STORE)
def backend(request: pytest.FixtureRequest) -> str:
    """PostgreSQL, the embedded SQLite default, and the in-memory store."""
    return str(request.param)


def _define(durable, name="sync", priority=0, **concurrency):
    wf = durable.workflow(name, concurrency={"limit": 1, **concurrency}, priority=priority)

    @wf.step
    def work(tenant, n):
        return n

    return wf


def _count_runs(durable) -> int:
    with durable.db.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(runs)).scalar_one())


def _hold(durable, run_id: str) -> None:
    """A live worker executes a step of the run: it holds its key's slot."""
    now = durable.db.utcnow()
    with durable.db.begin() as conn:
        conn.execute(
            runs.update()
            .where(runs.c.id == run_id)
            .values(status="running", locked_by="alive:1:1", heartbeat_at=now, started_at=now)
        )


def _end(durable, run_id: str) -> None:
    """The run finished; whoever finished it woke nobody (the test releases the slot itself)."""
    with durable.db.begin() as conn:
        conn.execute(
            runs.update()
            .where(runs.c.id == run_id)
            .values(status="completed", locked_by=None, finished_at=durable.db.utcnow())
        )


def _park(durable, wf, run_ids) -> None:
    """Each run's claim finds the slot taken: parked (a run parked at its start stays so)."""
    for run_id in run_ids:
        assert durable.engine.execute(wf, wf.steps[0], run_id, False) == "dropped"
    with durable.db.engine.connect() as conn:
        parked = conn.execute(select(func.count()).where(runs.c.id.in_(run_ids), runs.c.flow_wait == "slot"))
        assert parked.scalar_one() == len(run_ids)


def _turns(durable, outbox, wf, key, running, turns) -> list[str]:
    """The slot passes ``turns`` times: the run holding it ends, the release wakes the next one
    in line, which takes the slot; returns the runs woken, in order."""
    order = []
    for _ in range(turns):
        _end(durable, running)
        outbox.clear()
        flow.release(durable.runtime, wf, key)
        woken = outbox.run_ids()
        if not woken:
            break
        (running,) = woken
        _hold(durable, running)
        order.append(running)
    return order


@pytest.mark.parametrize(
    "options, message",
    [
        ({"concurrency": {"limit": 2, "fair": 7}}, "fair must be a template str or a callable"),
        ({"concurrency": {"limit": 2, "weights": {"a": 2}}}, "weights need a fair key"),
        ({"concurrency": {"limit": 2, "fair": "{t}", "weights": {"a": 0}}}, "must be in (0, 1000]"),
        ({"concurrency": {"limit": 2, "fair": "{t}", "weights": [("a", 2)]}}, "take a dict"),
        (
            {"concurrency": {"limit": 2, "fair": "{t}", "weights": {"a": True}}},
            "is not a str key and a number",
        ),
        ({"throttle": {"limit": 2, "period": 1, "fair": "{t}"}}, "not 'fair'"),
        ({"priority": 1.5}, "priority must be an int"),
        ({"priority": 1001}, "priority must be an int from -1000 to 1000"),
        ({"priority": True}, "priority must be an int"),
    ],
)
def test_bad_fair_and_priority_options_are_refused_when_the_workflow_is_defined(durable, options, message):
    with pytest.raises(InvalidDefinition, match=message.replace("(", r"\(").replace("]", r"\]")):
        durable.workflow("bad", **options)


def test_a_bad_priority_or_fair_key_refuses_the_start_and_writes_nothing(durable):
    _define(durable, fair="tenant:{tenant}")
    _define(durable, "orgs", fair="org:{org}")
    weighed = _define(durable, "weighed", fair=lambda data: data["tenant"], weights=lambda key: -1)
    for priority in ("high", True, 2.0, -1001):
        with pytest.raises(InvalidStart, match="priority must be an int"):
            durable.start("sync", {"tenant": "a", "n": 1}, priority=priority)
    with pytest.raises(InvalidStart, match="the concurrency fair key 'org:{org}' needs 'org' in the input"):
        durable.start("orgs", {"tenant": "a", "n": 1})
    with pytest.raises(InvalidStart, match="weight of fair key 'a' must be a number"):
        weighed.start({"tenant": "a", "n": 1})
    assert _count_runs(durable) == 0


def test_a_high_priority_run_takes_the_next_free_slot_ahead_of_every_parked_run(make_durable, backend):
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define(durable, key="{tenant}")
    holder = durable.start("sync", {"tenant": "a", "n": 0})
    _hold(durable, holder)
    waiting = [
        durable.start("sync", {"tenant": "a", "n": n})
        for n in range(1, 1001 if backend == "postgres" else 201)
    ]
    _park(durable, wf, waiting)
    urgent = durable.start("sync", {"tenant": "a", "n": -1}, priority=5)
    _park(durable, wf, [urgent])
    assert durable.get_run(urgent).priority == 5 and durable.get_run(waiting[0]).priority == 0
    assert _turns(durable, outbox, wf, "a", holder, 3) == [urgent, *waiting[:2]]  # then start order


def test_a_workflows_priority_is_its_runs_default_and_a_start_may_lower_it(make_durable):
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define(durable, priority=2)
    holder = wf.start({"tenant": "a", "n": 0})
    _hold(durable, holder)
    low = wf.start({"tenant": "a", "n": 1}, priority=-3)
    default = wf.start({"tenant": "a", "n": 2})
    _park(durable, wf, [low, default])
    assert (durable.get_run(low).priority, durable.get_run(default).priority) == (-3, 2)
    assert _turns(durable, outbox, wf, "", holder, 2) == [default, low]


def test_priority_ages_so_lower_priorities_progress_under_a_steady_stream_of_higher_ones(make_durable):
    """The aging rule: a run of priority p is lined up p * priority_aging seconds before its
    start. A run of priority 0 goes behind higher ones started within that time after it, and
    ahead of every one started later: under a steady stream of priority-1 runs it is woken once
    priority_aging has passed."""
    aging = 2.0
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox, priority_aging=aging)
    wf = _define(durable)
    holder = durable.start("sync", {"tenant": "a", "n": 0})
    _hold(durable, holder)
    low = durable.start("sync", {"tenant": "a", "n": 1})
    _park(durable, wf, [low])
    began = time.monotonic()
    running, turns = holder, 0
    while True:  # each turn a new priority-1 run joins the line, and the slot passes once
        urgent = durable.start("sync", {"tenant": "a", "n": 2}, priority=1)
        _park(durable, wf, [urgent])
        (running,) = _turns(durable, outbox, wf, "", running, 1)
        turns += 1
        if running == low:
            break
        assert time.monotonic() - began < 3 * aging, "the low-priority run waited past its aging"
        time.sleep(aging / 8)
    assert turns > 1, "the first priority-1 run, started within the aging, went ahead of it"
    assert time.monotonic() - began >= aging * 0.5


def test_fair_share_hands_the_slot_round_the_fair_keys_not_after_a_backlog(make_durable):
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define(durable, fair="tenant:{tenant}")
    holder = durable.start("sync", {"tenant": "big", "n": 0})
    _hold(durable, holder)
    backlog = [durable.start("sync", {"tenant": "big", "n": n}) for n in range(1, 41)]
    _park(durable, wf, backlog)
    small = {t: [durable.start("sync", {"tenant": t, "n": n}) for n in range(3)] for t in ("s1", "s2")}
    late = durable.start("sync", {"tenant": "s3", "n": 0})
    with durable.db.engine.connect() as conn:  # parked at their start: no message sent
        found = conn.execute(select(runs.c.flow_wait, runs.c.published).where(runs.c.id == late)).one()
    assert tuple(found) == ("slot", False)
    assert all(run_id not in outbox.run_ids() for run_id in (late, *small["s1"]))
    order = _turns(durable, outbox, wf, "", holder, 12)
    tenant = {run_id: "big" for run_id in backlog} | {r: t for t, ids in small.items() for r in ids}
    tenant[late] = "s3"
    seen = [tenant[run_id] for run_id in order]
    # Round the keys: each small tenant's runs come one a turn, between the backlog's.
    assert seen[:4].count("big") <= 2 and {"s1", "s2", "s3"} <= set(seen[:4])
    assert Counter(seen) == {"big": 5, "s1": 3, "s2": 3, "s3": 1}
    assert [r for r in order if tenant[r] == "s1"] == small["s1"]  # FIFO within a fair key
    assert [r for r in order if tenant[r] == "big"] == backlog[:5]


def test_weights_give_each_fair_key_its_share_of_the_turns(make_durable):
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define(durable, fair="tenant:{tenant}", weights={"tenant:gold": 3})
    holder = durable.start("sync", {"tenant": "gold", "n": 0})
    _hold(durable, holder)
    first = [durable.start("sync", {"tenant": t, "n": 0}) for t in ("gold", "free")]
    _park(durable, wf, first)
    for n in range(1, 100):  # both keep a backlog; parked at their start
        durable.start("sync", {"tenant": "gold", "n": n})
        durable.start("sync", {"tenant": "free", "n": n})
    order = _turns(durable, outbox, wf, "", holder, 80)
    with durable.db.engine.connect() as conn:
        keys = dict(conn.execute(select(runs.c.id, runs.c.fair_key).where(runs.c.id.in_(order))).all())
    gold = sum(keys[run_id] == "tenant:gold" for run_id in order) / len(order)
    assert len(order) == 80 and 0.75 * 0.9 <= gold <= 0.75 * 1.1  # 3 to 1, within 10 %


@pytest.mark.parametrize("backend", ["postgres"])
def test_fair_starts_from_many_threads_keep_the_limit_and_every_run_ends(make_durable):
    """Producers race on one fair slot key while a real worker claims, parks and wakes: never
    more than the limit at once, every run completes, none is left parked."""
    durable = make_durable()
    peaks, lock, now = [0], threading.Lock(), [0]
    wf = durable.workflow("race", concurrency={"limit": 2, "fair": "t:{tenant}"})

    @wf.step
    def work(tenant, n):
        with lock:
            now[0] += 1
            peaks[0] = max(peaks[0], now[0])
        time.sleep(0.01)
        with lock:
            now[0] -= 1

    ids: list[str] = []

    def produce(tenant: str) -> None:
        for n in range(15):
            run_id = durable.start("race", {"tenant": tenant, "n": n})
            with lock:
                ids.append(run_id)

    threads = [threading.Thread(target=produce, args=(f"t{i % 3}",)) for i in range(6)]
    with worker(durable, concurrency=4):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for run_id in ids:
            assert wait_for(durable, run_id, timeout=90).status == "completed"
    assert len(ids) == 90 and peaks[0] <= 2


def test_a_start_that_parks_behind_a_line_whose_slots_are_free_fills_them(make_durable):
    """The line is read without the key's lock: if the slots came free meanwhile (here, ends
    that woke nobody), the start fills them once committed, as a release would."""
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define(durable, fair="tenant:{tenant}")
    holder = durable.start("sync", {"tenant": "a", "n": 0})
    _hold(durable, holder)
    waiting = durable.start("sync", {"tenant": "a", "n": 1})
    _park(durable, wf, [waiting])
    _end(durable, holder)  # its slot is free, and nobody woke the parked run
    outbox.clear()
    late = durable.start("sync", {"tenant": "b", "n": 0})
    assert outbox.run_ids() == [waiting]  # the head of the line, woken after the start's commit
    with durable.db.engine.connect() as conn:
        assert conn.execute(select(runs.c.flow_wait).where(runs.c.id == late)).scalar_one() == "slot"


def test_a_freed_slot_wakes_the_line_not_waiting_for_new_runs_whose_messages_are_queued(make_durable):
    """A due run keeps a free slot only if it is ahead of the parked runs (woken, or back from a
    sleep); new runs behind the line, their messages still in the broker's queue, would park
    when claimed: the slot goes to the first parked run at once."""
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define(durable, key="{tenant}")
    holder = durable.start("sync", {"tenant": "a", "n": 0})
    _hold(durable, holder)
    parked = [durable.start("sync", {"tenant": "a", "n": n}) for n in range(1, 4)]
    _park(durable, wf, parked)
    queued = [durable.start("sync", {"tenant": "a", "n": n}) for n in range(4, 8)]  # not claimed yet
    assert _turns(durable, outbox, wf, "a", holder, 2) == parked[:2]
    for run_id in queued:  # their claims, when their messages come, park them behind the line
        assert durable.engine.execute(wf, wf.steps[0], run_id, False) == "dropped"


FAIR_RACE = """
import time
import redis

SPANS = {spans!r}


def define(durable):
    wf = durable.workflow("race", concurrency={{"limit": 2, "fair": "t:{{tenant}}"}})

    @wf.step
    def work(tenant, n):
        began = time.time()
        time.sleep(0.02)
        redis.Redis.from_url({redis!r}).rpush(SPANS, f"{{began}} {{time.time()}} {{tenant}}")
"""


@pytest.mark.parametrize("backend", ["postgres"])
def test_fair_starts_from_many_producers_on_two_worker_processes_keep_the_limit(
    make_durable, tmp_path, redis_client
):
    """Six producer threads start runs of three fair keys while two ``celery worker`` processes
    (three threads each) claim, park and wake them: never more than the limit's two steps at
    once across the processes, every run completes, every fair key is served."""
    import os
    import subprocess
    import sys
    import uuid

    from tests.conftest import REDIS_URL
    from tests.integration.helpers import ROOT, cli_app

    durable = make_durable()
    spans = f"durable-test-spans-{uuid.uuid4().hex}"
    source = FAIR_RACE.format(spans=spans, redis=REDIS_URL)
    cli_app(durable, tmp_path, "fairrace", source)  # writes fairrace.py: the app of the workers
    namespace: dict = {}
    exec(source, namespace)
    namespace["define"](durable)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    queue = durable.app.conf.task_default_queue
    command = [sys.executable, "-m", "celery", "-A", "fairrace", "worker", "-P", "threads", "-c", "3"]
    workers = [
        subprocess.Popen(
            [*command, "-Q", queue, "-n", f"fair{n}@%h", "--without-mingle", "--without-gossip"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for n in range(2)
    ]
    ids: list[str] = []
    lock = threading.Lock()

    def produce(tenant: str) -> None:
        for n in range(10):
            run_id = durable.start("race", {"tenant": tenant, "n": n})
            with lock:
                ids.append(run_id)

    try:
        producers = [threading.Thread(target=produce, args=(f"t{i % 3}",)) for i in range(6)]
        for thread in producers:
            thread.start()
        for thread in producers:
            thread.join()
        for run_id in ids:
            assert wait_for(durable, run_id, timeout=120).status == "completed"
    finally:
        for process in workers:
            process.terminate()
        for process in workers:
            process.wait(30)
    found = [line.decode().split() for line in redis_client.lrange(spans, 0, -1)]
    redis_client.delete(spans)
    assert len(found) == 60 and {tenant for _, _, tenant in found} == {"t0", "t1", "t2"}
    edges = sorted([(float(a), 1) for a, _, _ in found] + [(float(b), -1) for _, b, _ in found])
    running = peak = 0
    for _, change in edges:  # an end before a start at the same instant
        running += change
        peak = max(peak, running)
    assert peak <= 2
