"""Flow control per key (core/flow.py): concurrency slots, throttle and rate limit, decided by
the database on PostgreSQL, the SQLite file and the in-memory store, through a real worker."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select, text

from durable_celery import InvalidDefinition, InvalidStart, RateLimited
from durable_celery.core import flow
from durable_celery.core.flow import wake_slots_once
from durable_celery.core.sweeps import sweep_stale_once
from durable_celery.models import aware
from durable_celery.store import flow_rows
from durable_celery.store.schema import runs
from durable_celery.testing import RecordingOutbox, Sent, wait_for, worker
from tests.conftest import EVERY_STORE

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=EVERY_STORE)
def backend(request: pytest.FixtureRequest) -> str:
    """PostgreSQL, the embedded SQLite default, and the in-memory store."""
    return str(request.param)


def _count_runs(durable, workflow: str) -> int:
    with durable.db.engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(runs.c.workflow == workflow)).scalar_one())


class Peaks:
    """Steps running at once, per key, as the steps themselves see it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.order: list[tuple[str, int]] = []

    def enter(self, key: str, n: int) -> None:
        with self.lock:
            self.now[key] = self.now.get(key, 0) + 1
            self.peak[key] = max(self.peak.get(key, 0), self.now[key])
            self.order.append((key, n))

    def leave(self, key: str) -> None:
        with self.lock:
            self.now[key] -= 1


@pytest.mark.parametrize(
    "option, message",
    [
        ({"concurrency": {"limit": 0}}, "limit must be a positive int"),
        ({"concurrency": {"limit": True}}, "limit must be a positive int"),
        ({"concurrency": {"limit": 2.0}}, "limit must be a positive int"),
        ({"concurrency": 2}, "takes a dict"),
        ({"concurrency": {"limit": 2, "period": 3}}, "not 'period'"),
        ({"throttle": {"limit": 2}}, "needs a period"),
        ({"throttle": {"limit": 2, "period": 0}}, "period must be a positive number"),
        ({"throttle": {"limit": 2, "period": "60"}}, "period must be a positive number"),
        ({"rate_limit": {"limit": 2, "period": float("inf")}}, "period must be a positive number"),
        ({"rate_limit": {"limit": 1, "period": 1, "key": 7}}, "key must be a template str or a callable"),
    ],
)
def test_bad_options_are_refused_when_the_workflow_is_defined(durable, option, message):
    with pytest.raises(InvalidDefinition, match=message):
        durable.workflow("bad", **option)
    assert "bad" not in durable.workflows


def test_a_template_naming_a_missing_field_refuses_the_start_and_writes_nothing(durable):
    wf = durable.workflow("sync", concurrency={"limit": 1, "key": "tenant:{tenant}"})

    @wf.step
    def go(**data):
        return None

    with pytest.raises(InvalidStart, match="concurrency key 'tenant:{tenant}' needs 'tenant'"):
        durable.start("sync", {"customer": "c1"})
    assert _count_runs(durable, "sync") == 0


def test_concurrency_never_passes_the_limit_per_key_and_serves_each_key_in_start_order(durable):
    peaks = Peaks()
    wf = durable.workflow("sync", concurrency={"limit": 2, "key": "tenant:{tenant}"})

    @wf.step
    def fetch(tenant, n):
        peaks.enter(tenant, n)
        time.sleep(0.15)
        peaks.leave(tenant)

    @wf.step
    def store(tenant, n):
        peaks.enter(tenant, n)
        time.sleep(0.05)
        peaks.leave(tenant)

    ids = [durable.start("sync", {"tenant": "A", "n": n}) for n in range(8)]
    ids += [durable.start("sync", {"tenant": "B", "n": n}) for n in range(2)]
    with worker(durable, concurrency=6):
        for run_id in ids:
            assert wait_for(durable, run_id, timeout=60).status == "completed"
    assert peaks.peak["A"] == 2
    assert peaks.peak["B"] <= 2


def test_with_one_slot_each_run_goes_through_before_the_next_in_start_order(durable):
    peaks = Peaks()
    wf = durable.workflow("sync", concurrency={"limit": 1, "key": "tenant:{tenant}"})

    @wf.step
    def fetch(tenant, n):
        peaks.enter(tenant, n)
        time.sleep(0.02)
        peaks.leave(tenant)

    @wf.step
    def store(tenant, n):
        peaks.enter(tenant, n)
        peaks.leave(tenant)

    ids = [durable.start("sync", {"tenant": "A", "n": n}) for n in range(6)]
    with worker(durable, concurrency=4):
        for run_id in ids:
            assert wait_for(durable, run_id, timeout=60).status == "completed"
    # A run that goes on to its next step started before every run waiting: it goes first.
    assert peaks.order == [("A", n) for n in range(6) for _ in range(2)]
    assert peaks.peak["A"] == 1


def test_another_key_is_not_held_back_by_a_full_one(durable):
    release = threading.Event()
    wf = durable.workflow("sync", concurrency={"limit": 1, "key": "{tenant}"})

    @wf.step
    def work(tenant, n):
        if tenant == "busy":
            release.wait(30)

    busy = [durable.start("sync", {"tenant": "busy", "n": n}) for n in range(3)]
    with worker(durable, concurrency=4):
        if not durable.inline:  # a Fake runs one step at a time: nothing runs beside the busy one
            other = durable.start("sync", {"tenant": "calm", "n": 0})
            assert wait_for(durable, other, timeout=30).status == "completed"
            assert [durable.get_run(run_id).status for run_id in busy[1:]] == ["pending", "pending"]
        release.set()
        for run_id in busy:
            assert wait_for(durable, run_id, timeout=30).status == "completed"


def test_a_limit_without_key_covers_the_whole_workflow(durable):
    peaks = Peaks()
    wf = durable.workflow("report", concurrency={"limit": 1})

    @wf.step
    def build(n):
        peaks.enter("all", n)
        time.sleep(0.05)
        peaks.leave("all")

    ids = [durable.start("report", {"n": n}) for n in range(5)]
    with worker(durable, concurrency=4):
        for run_id in ids:
            assert wait_for(durable, run_id, timeout=60).status == "completed"
    assert peaks.peak["all"] == 1
    assert peaks.order == [("all", n) for n in range(5)]


def test_a_sleeping_run_holds_no_slot(durable):
    wf = durable.workflow("nap", concurrency={"limit": 1, "key": "k"})

    @wf.step
    def doze(n):
        from durable_celery import current_run

        if n == 0:
            current_run().sleep(2)

    sleeper = durable.start("nap", {"n": 0})
    with worker(durable, concurrency=2):
        wait_for(durable, sleeper, statuses=("waiting",), timeout=30)
        other = durable.start("nap", {"n": 1})
        assert wait_for(durable, other, timeout=30).status == "completed"
        assert durable.get_run(sleeper).status == "waiting"
        assert wait_for(durable, sleeper, timeout=30).status == "completed"


def test_a_dead_workers_slot_comes_back_when_its_lock_goes_stale(make_durable):
    durable = make_durable(stale_lock_timeout=1.0, heartbeat_interval=0.2)
    wf = durable.workflow("sync", concurrency={"limit": 1, "key": "{tenant}"})

    @wf.step
    def work(tenant):
        return tenant

    first = durable.start("sync", {"tenant": "t"})
    second = durable.start("sync", {"tenant": "t"})
    # A worker that claimed the first run and died: locked, never beats again.
    step = wf.steps[0]
    assert durable.engine.execute(wf, step, second, False) == "dropped"  # parked behind the first
    with durable.db.begin() as conn:
        conn.execute(
            runs.update()
            .where(runs.c.id == first)
            .values(
                status="running",
                locked_by="gone:1:1",
                heartbeat_at=durable.db.utcnow() - timedelta(seconds=9),
            )
        )
    assert durable.engine.execute(wf, step, second, False) == "dropped"  # still parked: the slot is held
    assert durable.get_run(second).status == "pending"
    handed_back, _failed = sweep_stale_once(durable.runtime)
    assert handed_back == [first]
    with worker(durable, concurrency=2):
        assert wait_for(durable, first, timeout=30).status == "completed"
        assert wait_for(durable, second, timeout=30).status == "completed"
    assert wake_slots_once(durable.runtime) == 0  # nothing left parked


# -- the upkeep's pass: slots a crash or a lost wake-up left free ---------------------------------


def _define_sync(durable, limit=1, name="sync"):
    wf = durable.workflow(name, concurrency={"limit": limit, "key": "{tenant}"})

    @wf.step
    def work(tenant, n):
        return n

    return wf


def _hold(durable, *run_ids: str) -> None:
    """A live worker executes a step of each run (locked, beating): each holds its key's slot."""
    now = durable.db.utcnow()
    with durable.db.begin() as conn:
        conn.execute(
            runs.update()
            .where(runs.c.id.in_(run_ids))
            .values(status="running", locked_by="alive:1:1", heartbeat_at=now, started_at=now)
        )


def _end_unannounced(durable, *run_ids: str) -> None:
    """The runs finished, and the process that finished them died before waking anyone."""
    with durable.db.begin() as conn:
        conn.execute(
            runs.update()
            .where(runs.c.id.in_(run_ids))
            .values(status="completed", locked_by=None, finished_at=durable.db.utcnow())
        )


def _park(durable, wf, *run_ids: str) -> None:
    """Each run's claim finds its key's slots taken: parked."""
    for run_id in run_ids:
        assert durable.engine.execute(wf, wf.steps[0], run_id, False) == "dropped"
    assert _parked(durable, *run_ids) == list(run_ids)


def _parked(durable, *run_ids: str) -> list[str]:
    """Which of these runs are parked for a slot."""
    with durable.db.engine.connect() as conn:
        found = conn.execute(select(runs.c.id).where(runs.c.id.in_(run_ids), runs.c.flow_wait == "slot"))
        return sorted((row.id for row in found), key=run_ids.index)


def _lost_wake_ups(durable, wf, tenants) -> list[str]:
    """Per tenant, a run parked behind one that ended without waking it: returns the parked ones."""
    started = [
        (durable.start(wf.name, {"tenant": t, "n": 0}), durable.start(wf.name, {"tenant": t, "n": 1}))
        for t in tenants
    ]
    _hold(durable, *(first for first, _ in started))
    _park(durable, wf, *(second for _, second in started))
    _end_unannounced(durable, *(first for first, _ in started))
    return [second for _, second in started]


def _await_a_key_lock_wait(durable) -> None:
    """Until a session of the test's database waits for an advisory lock (a flow key's)."""
    waiting = text(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
    )
    deadline = time.monotonic() + 30
    with durable.db.engine.connect() as watch:
        # pg_stat_activity is read once per transaction: each look is a transaction of its own.
        while watch.execute(waiting).scalar_one() == 0:
            watch.rollback()
            assert time.monotonic() < deadline, "nothing waited for the key's lock"
            time.sleep(0.02)


def test_the_upkeep_wakes_as_many_parked_runs_as_slots_are_free_oldest_first(make_durable):
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define_sync(durable, limit=2)
    a = [durable.start("sync", {"tenant": "a", "n": n}) for n in range(5)]
    b = [durable.start("sync", {"tenant": "b", "n": n}) for n in range(3)]
    _hold(durable, a[0], a[1], b[0], b[1])
    _park(durable, wf, *a[2:], b[2])
    outbox.clear()
    assert wake_slots_once(durable.runtime) == 0  # every slot in use
    _end_unannounced(durable, a[0], b[0], b[1])  # a: one slot free; b: two, one run parked
    assert wake_slots_once(durable.runtime) == 2
    assert [(sent.workflow, sent.run_id, sent.step_index) for sent in outbox.sent] == [
        ("sync", a[2], 0),
        ("sync", b[2], 0),
    ]
    assert _parked(durable, *a, *b) == [a[3], a[4]]
    assert durable.get_run(a[2]).status == "pending"
    # The woken run is due: it has the free slot, so the next pass wakes no other for it.
    assert wake_slots_once(durable.runtime) == 0
    assert _parked(durable, *a) == [a[3], a[4]]


def test_the_upkeep_leaves_the_keys_of_workflows_defined_elsewhere_to_their_nodes(make_durable):
    outbox = RecordingOutbox()
    here = make_durable(outbox=outbox)
    there = make_durable("there")
    # "a-report" sorts before "sync": a pass meets the key it must leave alone first.
    theirs = _lost_wake_ups(there, _define_sync(there, name="a-report"), ["t"])
    ours = _lost_wake_ups(here, _define_sync(here), ["t"])
    outbox.clear()
    assert wake_slots_once(here.runtime) == 1
    assert outbox.run_ids() == ours
    assert _parked(here, *theirs, *ours) == theirs
    assert wake_slots_once(there.runtime) == 1
    assert _parked(here, *theirs, *ours) == []


def test_the_upkeep_wakes_every_run_parked_for_a_limit_a_deploy_removed(make_durable):
    before = make_durable()
    wf = _define_sync(before, limit=1)
    ids = [before.start("sync", {"tenant": "a", "n": n}) for n in range(4)]
    _hold(before, ids[0])
    _park(before, wf, *ids[1:])
    outbox = RecordingOutbox()
    after = make_durable("after", outbox=outbox)
    unlimited = after.workflow("sync")  # the new code: no concurrency limit

    @unlimited.step
    def work(tenant, n):
        return n

    assert wake_slots_once(after.runtime) == 3
    assert outbox.run_ids() == ids[1:]
    assert _parked(after, *ids) == []


def test_each_upkeep_pass_goes_on_with_the_keys_after_the_last_one_looked_at(make_durable, monkeypatch):
    monkeypatch.setattr(flow, "KEYS_PER_PASS", 2)
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define_sync(durable)
    parked = _lost_wake_ups(durable, wf, ["k0", "k1", "k2", "k3", "k4"])
    outbox.clear()
    waker = flow.SlotWaker(durable.runtime)
    passes = []
    for _ in range(4):
        woken = waker.wake_slots_once()
        passes.append((woken, outbox.run_ids()))
        outbox.clear()
    assert passes == [(2, parked[0:2]), (2, parked[2:4]), (1, parked[4:]), (0, [])]
    # Past the last key, a pass starts from the first again.
    more = _lost_wake_ups(durable, wf, ["a0"])
    outbox.clear()
    assert waker.wake_slots_once() == 1 and outbox.run_ids() == more


def test_a_pass_goes_on_after_keys_it_could_wake_nothing_for(make_durable, monkeypatch):
    monkeypatch.setattr(flow, "KEYS_PER_PASS", 3)
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wa, wb = _define_sync(durable, name="wa"), _define_sync(durable, name="wb")

    def full(wf, tenant):  # a run holds the key's one slot, another is parked behind it
        holder, parked = (durable.start(wf.name, {"tenant": tenant, "n": n}) for n in range(2))
        _hold(durable, holder)
        _park(durable, wf, parked)

    # The keys in the order a pass reads them: three full ones, then two with a slot free.
    full(wa, "k0")
    full(wa, "k9")
    full(wb, "k1")
    free = _lost_wake_ups(durable, wb, ["k5", "k7", "k8"])
    outbox.clear()
    waker = flow.SlotWaker(durable.runtime)
    passes = []
    for _ in range(3):
        woken = waker.wake_slots_once()
        passes.append((woken, outbox.run_ids()))
        outbox.clear()
    # The first pass finds no slot free in its three keys; the next goes on after the last of
    # them (not from it again), the third after the last key there is.
    assert passes == [(0, []), (3, free), (0, [])]


def test_a_pass_passes_over_keys_whose_parked_runs_ended(make_durable, monkeypatch):
    monkeypatch.setattr(flow, "KEYS_PER_PASS", 2)
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define_sync(durable)
    for tenant in ("a0", "a1"):  # a run parked behind another, then cancelled while parked
        holder, parked = (durable.start("sync", {"tenant": tenant, "n": n}) for n in range(2))
        _hold(durable, holder)
        _park(durable, wf, parked)
        assert durable.cancel(parked) and durable.get_run(parked).status == "cancelled"
    free = _lost_wake_ups(durable, wf, ["b0"])
    outbox.clear()
    assert flow.SlotWaker(durable.runtime).wake_slots_once() == 1 and outbox.run_ids() == free


@pytest.mark.parametrize("backend", ["postgres"])
def test_the_upkeep_pass_waits_for_the_keys_lock(durable):
    wf = _define_sync(durable)
    (parked,) = _lost_wake_ups(durable, wf, ["a"])
    woken: list[int] = []
    with durable.db.begin() as conn:
        flow_rows.lock_key_txn(conn, "slot", "sync", "a")  # a claim of the key's, in progress
        thread = threading.Thread(target=lambda: woken.append(wake_slots_once(durable.runtime)))
        thread.start()
        _await_a_key_lock_wait(durable)
        assert woken == [] and _parked(durable, parked) == [parked]
    thread.join(30)
    assert woken == [1] and _parked(durable, parked) == []


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_rate_limited_start_waits_for_its_keys_lock(durable):
    wf = durable.workflow("remind", rate_limit={"limit": 1, "period": 3600, "key": "user:{user}"})

    @wf.step
    def send(user):
        return user

    started: list[str] = []
    with durable.db.begin() as conn:
        flow_rows.lock_key_txn(conn, "rate", "remind", "user:1")  # another start of the key, in progress
        thread = threading.Thread(target=lambda: started.append(durable.start("remind", {"user": 1})))
        thread.start()
        _await_a_key_lock_wait(durable)
        assert started == [] and _count_runs(durable, "remind") == 0
    thread.join(30)
    assert len(started) == 1 and _count_runs(durable, "remind") == 1


@pytest.mark.parametrize("backend", ["memory"])
def test_a_refused_start_names_its_limit_and_when_to_try_again_to_the_millisecond(backend):
    from durable_celery.testing import Fake

    fake = Fake()
    try:
        remind = fake.workflow("remind", rate_limit={"limit": 2, "period": 60, "key": "u:{user}"})

        @remind.step
        def send(user):
            return user

        fake.start("remind", {"user": 1})
        fake.advance(10)
        fake.start("remind", {"user": 1})
        fake.advance(49.87654)  # the first start leaves the window in 0.12346 s
        with pytest.raises(RateLimited) as refused:
            fake.start("remind", {"user": 1})
        got = refused.value
        assert (got.workflow, got.key, got.limit, got.period, got.retry_after) == (
            "remind",
            "u:1",
            2,
            60,
            0.123,
        )
        assert "at most 2 start(s) per 60s for 'u:1'" in str(got)
    finally:
        fake.close()


def test_a_parked_run_is_noted_once_with_its_key_and_limit(make_durable):
    durable = make_durable()
    wf = _define_sync(durable)
    first, second = (durable.start("sync", {"tenant": "a", "n": n}) for n in range(2))
    _hold(durable, first)
    _park(durable, wf, second)
    assert durable.engine.execute(wf, wf.steps[0], second, False) == "dropped"  # looks again: no new note
    noted = durable.activity(kinds=["slot_wait"])
    assert [(a.run_id, a.workflow, a.details) for a in noted] == [
        (second, "sync", {"key": "a", "workflow": "sync", "in_use": 1, "limit": 1})
    ]

    api = durable.workflow("api", throttle={"limit": 1, "period": 60, "key": "c:{customer}"})

    @api.step
    def call(customer):
        return customer

    begun, held_back = (durable.start("api", {"customer": "x"}) for _ in range(2))
    assert durable.engine.execute(api, api.steps[0], begun, False) != "dropped"
    assert durable.engine.execute(api, api.steps[0], held_back, False) == "dropped"
    (throttled,) = durable.activity(kinds=["throttled"])
    assert (throttled.run_id, throttled.workflow) == (held_back, "api")
    until = throttled.details.pop("until")
    assert throttled.details == {"key": "c:x", "workflow": "api", "limit": 1, "period": 60}
    assert (
        durable.get_run(held_back).status == "pending"
        and until > durable.get_run(begun).started_at.isoformat()
    )


def test_a_claim_that_parks_wakes_the_runs_parked_longer_for_the_slots_free(make_durable):
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define_sync(durable)
    (parked,) = _lost_wake_ups(durable, wf, ["a"])  # its slot is free, and nobody woke it
    later = durable.start("sync", {"tenant": "a", "n": 2})
    outbox.clear()
    _park(durable, wf, later)  # behind the run parked longer, which takes the free slot
    assert outbox.run_ids() == [parked]
    assert _parked(durable, parked, later) == [later]


def test_a_limited_workflows_waiting_run_times_out_from_when_it_takes_the_key(durable):
    entered, release = threading.Event(), threading.Event()
    wf = durable.workflow(
        "slow_sync", timeout=3.0, on_duplicate="run_again", concurrency={"limit": 1, "key": "{tenant}"}
    )

    @wf.step
    def work(tenant, n):
        if n == 0:
            entered.set()
            assert release.wait(30)
            return n
        end = time.monotonic() + 10  # longer than the timeout: stopped at its deadline
        while time.monotonic() < end:
            time.sleep(0.02)
        return n

    with worker(durable):
        holder = durable.start(wf, {"tenant": "a", "n": 0}, key="k")
        assert entered.wait(10)  # running: a start now waits for it, not takes its place
        waiting = durable.start(wf, {"tenant": "a", "n": 1}, key="k")  # no deadline until it has the key
        release.set()
        assert wait_for(durable, holder).status == "completed"
        run = wait_for(durable, waiting, timeout=30)
    assert run.status == "failed" and run.error["type"] == "WorkflowTimeout"


def test_a_throttled_run_once_claimed_waits_for_its_limit_no_more(make_durable):
    durable = make_durable()
    api = durable.workflow("api", throttle={"limit": 1, "period": 60, "key": "c:{customer}"})

    @api.step
    def call(customer):
        return customer

    @api.step
    def log(customer):
        return customer

    def parked() -> float:
        return durable.metrics.value("durable_flow_waiting", {"workflow": "api", "wait": "throttle"}) or 0

    begun, held_back = (durable.start("api", {"customer": "x"}) for _ in range(2))
    assert durable.engine.execute(api, api.steps[0], begun, False) != "dropped"
    assert durable.engine.execute(api, api.steps[0], held_back, False) == "dropped"
    assert parked() == 1
    # The throttle counts a run's begin: the begun run's next step goes at once, in the window.
    assert durable.engine.execute(api, api.steps[1], begun, False) == "completed"
    # The window moves on: the first begin is older than the period, and the parked run is due.
    with durable.db.begin() as conn:
        earlier = durable.db.utcnow() - timedelta(seconds=61)
        conn.execute(runs.update().where(runs.c.id == begun).values(started_at=earlier))
        conn.execute(runs.update().where(runs.c.id == held_back).values(due_at=durable.db.utcnow()))
    assert durable.engine.execute(api, api.steps[0], held_back, False) != "dropped"
    assert durable.get_run(held_back).status in ("pending", "running")  # its second step to go
    assert parked() == 0


def test_a_woken_run_is_sent_in_the_background_as_it_stands(make_durable):
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define_sync(durable)
    holder = durable.start("sync", {"tenant": "a", "n": 0})
    parked = durable.start("sync", {"tenant": "a", "n": 1}, key="order:1")
    _hold(durable, holder)
    _park(durable, wf, parked)
    _end_unannounced(durable, holder)
    outbox.clear()
    flow.release(durable.runtime, wf, "a")  # as the worker that ended a step of the key does
    assert outbox.sent == [Sent("sync", 0, parked, 1, "order:1", soon=True)]


def test_a_woken_run_counts_as_sent_and_its_resends_start_afresh(make_durable):
    from durable_celery.worker.relay import relay_once
    from tests.integration.helpers import run_row

    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define_sync(durable)
    holder, parked = (durable.start("sync", {"tenant": "a", "n": n}) for n in range(2))
    # Its message went out three times before (the relay's re-sends), the last long ago.
    long_ago = durable.db.utcnow() - timedelta(hours=1)
    with durable.db.begin() as conn:
        conn.execute(runs.update().where(runs.c.id == parked).values(resends=3, resend_at=long_ago))
    _hold(durable, holder)
    _park(durable, wf, parked)
    _end_unannounced(durable, holder)
    flow.release(durable.runtime, wf, "a")
    outbox.clear()
    # Its wake-up message is on its way: the relay neither sends it (it is sent) nor sends it
    # again (its first re-send is relay_after from now), and its re-sends count from 0.
    assert relay_once(durable.runtime, durable.app) == 0 and outbox.sent == []
    row = run_row(durable, parked)
    assert (row.published, row.resends, row.resend_at) == (True, 0, None)


def test_the_parked_runs_are_woken_in_line_order_line_at_then_id(make_durable):
    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    wf = _define_sync(durable)
    holder = durable.start("sync", {"tenant": "a", "n": 0})
    started = [durable.start("sync", {"tenant": "a", "n": n}) for n in range(1, 4)]
    _hold(durable, holder)
    _park(durable, wf, *started)
    low, high = sorted(started[:2])  # ids: the lower one goes first among runs started at once
    with durable.db.engine.connect() as conn:
        at = conn.execute(select(runs.c.line_at).where(runs.c.id == high)).scalar_one()
    with durable.db.begin() as conn:
        # The third is lined up before them all (its id says otherwise); the lower id's row is
        # written again (stored after the other now), lined up at the same moment as the higher.
        conn.execute(runs.update().where(runs.c.id == started[2]).values(line_at=at - timedelta(seconds=1)))
        conn.execute(runs.update().where(runs.c.id == low).values(line_at=at))
    _end_unannounced(durable, holder)
    order = []
    for _ in range(3):  # one slot: each run woken takes it, and ends
        outbox.clear()
        flow.release(durable.runtime, wf, "a")
        (woken,) = outbox.run_ids()
        order.append(woken)
        _end_unannounced(durable, woken)
    assert order == [started[2], low, high]


def test_a_message_for_a_run_not_waiting_at_that_step_parks_nothing(make_durable):
    durable = make_durable()
    wf = durable.workflow("sync", concurrency={"limit": 1, "key": "{tenant}"})

    @wf.step
    def first(tenant, n):
        return n

    @wf.step
    def second(tenant, n):
        return n

    holder, moved_on, running, undoing, ended, later = (
        durable.start("sync", {"tenant": "a", "n": n}) for n in range(6)
    )
    _hold(durable, holder)  # the key's one slot, in use
    in_an_hour = durable.db.utcnow() + timedelta(hours=1)
    with durable.db.begin() as conn:
        conn.execute(runs.update().where(runs.c.id == moved_on).values(step_index=1))
        conn.execute(runs.update().where(runs.c.id == later).values(due_at=in_an_hour))  # snoozed, say
        # Its compensation is due (a compensation needs no slot).
        conn.execute(runs.update().where(runs.c.id == undoing).values(status="compensating"))
    _hold(durable, running)  # a worker runs its step (a message delivered twice)
    assert durable.cancel(ended)
    late = (moved_on, running, undoing, ended, later)
    # A late or repeated message of step 0 finds each one's key full, and parks none of them.
    for run_id in late:
        assert durable.engine.execute(wf, wf.steps[0], run_id, False) == "dropped"
    assert _parked(durable, *late) == []
    assert durable.engine.execute(wf, wf.steps[1], moved_on, False) == "dropped"  # its own step: parked
    assert _parked(durable, *late) == [moved_on]
    assert _due_at(durable, later) == in_an_hour


def test_a_throttled_run_is_sent_by_the_relay_as_soon_as_its_look_again_is_due(make_durable):
    from durable_celery.worker.relay import relay_once

    outbox = RecordingOutbox()
    durable = make_durable(outbox=outbox)
    api = durable.workflow("api", throttle={"limit": 1, "period": 60, "key": "c:{customer}"})

    @api.step
    def call(customer):
        return customer

    begun, held_back = (durable.start("api", {"customer": "x"}) for _ in range(2))
    assert durable.engine.execute(api, api.steps[0], begun, False) != "dropped"
    assert durable.engine.execute(api, api.steps[0], held_back, False) == "dropped"
    outbox.clear()
    assert relay_once(durable.runtime, durable.app) == 0  # parked until its place frees
    with durable.db.begin() as conn:  # the time to look again has come
        conn.execute(runs.update().where(runs.c.id == held_back).values(due_at=durable.db.utcnow()))
    assert relay_once(durable.runtime, durable.app) == 1 and outbox.run_ids() == [held_back]


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_claim_takes_no_lock_of_a_limit_its_workflow_no_longer_has(make_durable):
    before = make_durable()
    old = before.workflow(
        "sync",
        concurrency={"limit": 1, "key": "{tenant}"},
        throttle={"limit": 5, "period": 60, "key": "c:{tenant}"},
    )
    old.step(lambda tenant: tenant, name="work")
    run_id = before.start("sync", {"tenant": "a"})  # its row names a throttle key, c:a
    after = make_durable("after")
    new = after.workflow("sync", concurrency={"limit": 1, "key": "{tenant}"})  # a deploy removed the throttle
    new.step(lambda tenant: tenant, name="work")
    done: list[str] = []
    with after.db.begin() as conn:
        flow_rows.lock_key_txn(
            conn, "throttle", "sync", "c:a"
        )  # a decision of the old throttle's, in progress
        claim = threading.Thread(
            target=lambda: done.append(after.engine.execute(new, new.steps[0], run_id, False))
        )
        claim.start()
        claim.join(10)
        assert done == ["completed"]  # it went on without the throttle key's lock


def test_a_throttled_run_counts_the_line_ahead_of_it_up_to_its_windows(durable, monkeypatch):
    monkeypatch.setattr(flow, "LINE_WINDOWS", 2)  # the line is counted up to 2 windows' worth
    period, margin = 60, flow.CLOCK_MARGIN if durable.db.is_postgres else 0.0
    api = durable.workflow("api", throttle={"limit": 1, "period": period, "key": "c:{customer}"})

    @api.step
    def call(customer):
        return customer

    begun, *line = (durable.start("api", {"customer": "x"}) for _ in range(6))
    assert durable.engine.execute(api, api.steps[0], begun, False) != "dropped"
    for run_id in line:
        assert durable.engine.execute(api, api.steps[0], run_id, False) == "dropped"
    t0 = durable.get_run(begun).started_at
    # Places 0, 1, then 2 for all the runs further back: they look again two windows on.
    windows = [1, 2, 3, 3, 3]
    assert [_due_at(durable, run_id) for run_id in line] == [
        t0 + timedelta(seconds=period * w + margin) for w in windows
    ]


def test_a_run_lined_up_earlier_is_ahead_in_the_throttles_line_whatever_its_id(durable):
    period, margin = 60, flow.CLOCK_MARGIN if durable.db.is_postgres else 0.0
    api = durable.workflow("api", throttle={"limit": 1, "period": period, "key": "c:{customer}"})

    @api.step
    def call(customer):
        return customer

    begun, low, high = (durable.start("api", {"customer": "x"}) for _ in range(3))
    low, high = sorted((low, high))
    assert durable.engine.execute(api, api.steps[0], begun, False) != "dropped"
    with durable.db.engine.connect() as conn:
        at = conn.execute(select(runs.c.line_at).where(runs.c.id == low)).scalar_one()
    with durable.db.begin() as conn:  # the higher id was lined up first
        conn.execute(runs.update().where(runs.c.id == high).values(line_at=at - timedelta(seconds=1)))
    for run_id in (high, low):
        assert durable.engine.execute(api, api.steps[0], run_id, False) == "dropped"
    t0 = durable.get_run(begun).started_at
    assert _due_at(durable, high) == t0 + timedelta(seconds=period + margin)
    assert _due_at(durable, low) == t0 + timedelta(seconds=2 * period + margin)  # behind the higher id


def _due_at(durable, run_id: str):
    with durable.db.engine.connect() as conn:
        return aware(conn.execute(select(runs.c.due_at).where(runs.c.id == run_id)).scalar_one())


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_a_throttled_run_looks_again_when_its_place_in_the_window_frees(durable):
    period, margin = 60, flow.CLOCK_MARGIN if durable.db.is_postgres else 0.0
    api = durable.workflow("api", throttle={"limit": 2, "period": period, "key": "c:{customer}"})

    @api.step
    def call(customer, n):
        return n

    ids = [durable.start("api", {"customer": "x", "n": n}) for n in range(16)]
    for run_id in ids[:2]:
        assert durable.engine.execute(api, api.steps[0], run_id, False) != "dropped"
    t0, t1 = (durable.get_run(run_id).started_at for run_id in ids[:2])
    for run_id in ids[2:]:  # each behind the ones before it: places 0, 1, 2, ...
        assert durable.engine.execute(api, api.steps[0], run_id, False) == "dropped"
    frees = [t0 + timedelta(seconds=period), t1 + timedelta(seconds=period)]
    expected = [frees[p % 2] + timedelta(seconds=period * (p // 2) + margin) for p in range(14)]
    assert [_due_at(durable, run_id) for run_id in ids[2:]] == expected


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_a_throttle_lowered_below_the_begins_in_its_window_waits_for_the_newest_to_leave(durable):
    period, margin = 60, flow.CLOCK_MARGIN if durable.db.is_postgres else 0.0
    api = durable.workflow("api", throttle={"limit": 1, "period": period, "key": "c:{customer}"})

    @api.step
    def call(customer):
        return customer

    *earlier, run_id = (durable.start("api", {"customer": "x"}) for _ in range(4))
    now = durable.db.utcnow()
    # Three begins in the window, more than the limit allows (a deploy lowered it from 3).
    begins = [now - timedelta(seconds=s) for s in (30, 20, 10)]
    with durable.db.begin() as conn:
        for earlier_id, at in zip(earlier, begins, strict=True):
            done = {"status": "completed", "started_at": at, "finished_at": at}
            conn.execute(runs.update().where(runs.c.id == earlier_id).values(**done))
    assert durable.engine.execute(api, api.steps[0], run_id, False) == "dropped"
    assert _due_at(durable, run_id) == begins[-1] + timedelta(seconds=period + margin)


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_run_due_this_very_moment_is_in_the_throttles_line(durable, monkeypatch):
    api = durable.workflow("api", throttle={"limit": 1, "period": 60, "key": "c:{customer}"})

    @api.step
    def call(customer):
        return customer

    frozen = durable.db.utcnow()  # SQLite reads this host's clock: every time below is this one
    monkeypatch.setattr(durable.db, "clock", lambda: frozen)
    begun, due_now, third = (durable.start("api", {"customer": "x"}) for _ in range(3))
    assert durable.engine.execute(api, api.steps[0], begun, False) != "dropped"
    # ``due_now`` is due at this very moment, its message on the way: it goes before ``third``,
    # which takes the place after it, two periods on.
    assert durable.engine.execute(api, api.steps[0], third, False) == "dropped"
    assert _due_at(durable, third) == frozen + timedelta(seconds=120)
    assert _due_at(durable, due_now) == frozen


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_throttled_run_looks_again_soon_when_this_hosts_clock_is_ahead(durable, monkeypatch):
    api = durable.workflow("api", throttle={"limit": 1, "period": 5, "key": "c:{customer}"})

    @api.step
    def call(customer):
        return customer

    first, second = (durable.start("api", {"customer": "x"}) for _ in range(2))
    assert durable.engine.execute(api, api.steps[0], first, False) != "dropped"
    # This host reads the moment the first begin leaves the window while the database's clock
    # still counts it: the place is free by this host's clock, so the run looks again shortly.
    ahead = durable.get_run(first).started_at + timedelta(seconds=5)
    monkeypatch.setattr(durable.db, "clock", lambda: ahead)
    assert durable.engine.execute(api, api.steps[0], second, False) == "dropped"
    assert _due_at(durable, second) == ahead + timedelta(seconds=flow.MIN_RECHECK)


def test_a_run_on_a_paused_queue_is_not_noted_throttled(make_durable):
    durable = make_durable()
    api = durable.workflow("api", throttle={"limit": 1, "period": 60, "key": "c:{customer}"})

    @api.step
    def call(customer):
        return customer

    first, second = (durable.start("api", {"customer": "x"}) for _ in range(2))
    assert durable.engine.execute(api, api.steps[0], first, False) != "dropped"
    queue = durable.app.conf.task_default_queue
    durable.pause_queue(queue)
    assert durable.engine.execute(api, api.steps[0], second, False) == "dropped"
    assert durable.activity(kinds=["throttled"]) == []  # not parked: the queue holds it
    durable.resume_queue(queue)
    assert durable.engine.execute(api, api.steps[0], second, False) == "dropped"
    assert [a.run_id for a in durable.activity(kinds=["throttled"])] == [second]


def _waits_for_the_key_lock(durable, key: str, act, seen, kind: str = "slot", workflow: str = "sync") -> None:
    """``act()`` in a thread waits while another transaction holds the flow key's lock (a slot
    key's by default): what ``seen()`` reads changes only once that transaction ends."""
    before, done = seen(), []
    with durable.db.begin() as conn:
        flow_rows.lock_key_txn(conn, kind, workflow, key)  # another decision of the key's, in progress
        thread = threading.Thread(target=lambda: done.append(act()))
        thread.start()
        _await_a_key_lock_wait(durable)
        assert done == [] and seen() == before
    thread.join(30)
    assert len(done) == 1 and seen() != before


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_claim_and_a_release_wait_for_the_slot_keys_lock(durable):
    wf = _define_sync(durable)
    (parked,) = _lost_wake_ups(durable, wf, ["a"])
    fresh = durable.start("sync", {"tenant": "b", "n": 0})
    claim = lambda: durable.engine.execute(wf, wf.steps[0], fresh, False)  # noqa: E731
    _waits_for_the_key_lock(durable, "b", claim, lambda: durable.get_run(fresh).status)
    release = lambda: flow.release(durable.runtime, wf, "a")  # noqa: E731
    _waits_for_the_key_lock(durable, "a", release, lambda: _parked(durable, parked))
    assert durable.get_run(fresh).status == "completed" and _parked(durable, parked) == []


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_throttled_claim_waits_for_the_throttle_keys_lock(durable):
    api = durable.workflow("api", throttle={"limit": 1, "period": 60, "key": "c:{customer}"})

    @api.step
    def call(customer):
        return customer

    run_id = durable.start("api", {"customer": "x"})
    claim = lambda: durable.engine.execute(api, api.steps[0], run_id, False)  # noqa: E731
    seen = lambda: durable.get_run(run_id).status  # noqa: E731
    _waits_for_the_key_lock(durable, "c:x", claim, seen, kind="throttle", workflow="api")
    assert durable.get_run(run_id).status == "completed"


def test_a_compensation_runs_while_every_slot_of_its_key_is_in_use(make_durable):
    durable = make_durable()
    undone: list[int] = []
    wf = durable.workflow("sync", concurrency={"limit": 1, "key": "{tenant}"})

    @wf.step(compensate=lambda tenant, n: undone.append(n))
    def first(tenant, n):
        return n

    @wf.step
    def second(tenant, n):
        if n == 0:
            raise ValueError("declined")

    failing, other = (durable.start("sync", {"tenant": "a", "n": n}) for n in range(2))
    assert durable.run_message("sync", 0, failing) == "running"
    assert durable.run_message("sync", 1, failing) == "compensating"
    _hold(durable, other)  # the key's one slot, in use
    assert durable.run_message("sync", 0, failing, compensate=True) == "compensated"
    assert undone == [0]


def test_a_lost_step_of_a_run_whose_limit_a_deploy_removed_is_recorded(make_durable):
    from durable_celery.core.engine import process_node
    from durable_celery.store import queries

    before = make_durable()
    _define_sync(before)
    run_id = before.start("sync", {"tenant": "a", "n": 0})
    after = make_durable("after")
    unlimited = after.workflow("sync")  # the new code: no concurrency limit

    @unlimited.step
    def work(tenant, n):
        return n

    dead = 4_000_000  # above any pid_max
    with after.db.single() as conn:
        assert queries.claim_run(after.db, conn, run_id, 0, f"{process_node(dead)}:7", None) is not None
    assert (
        after.engine.record_lost(unlimited, unlimited.steps[0], run_id, dead, "signal 9 (SIGKILL)")
        == "failed"
    )
    assert after.get_run(run_id).error["type"] == "WorkerLost"


def test_throttle_spaces_the_begins_in_start_order_and_drops_none(durable):
    begun: list[int] = []
    wf = durable.workflow("api", throttle={"limit": 2, "period": 1.0, "key": "c:{customer}"})

    @wf.step
    def call(customer, n):
        begun.append(n)

    ids = [durable.start("api", {"customer": "x", "n": n}) for n in range(6)]
    with worker(durable, concurrency=4):
        for run_id in ids:
            assert wait_for(durable, run_id, timeout=60).status == "completed"
    assert sorted(begun) == list(range(6))
    began = [durable.get_run(run_id).started_at for run_id in ids]  # in start order
    # Start order: no run begins a window (1 s) after one started later. Two whose places free
    # in the same moment may be claimed either way round, by however busy a worker's threads are.
    for earlier, later in zip(began, began[1:], strict=False):
        assert earlier <= later + timedelta(seconds=0.5)
    starts = sorted(began)
    for i in range(2, 6):  # any 3 consecutive begins span at least the period
        assert (starts[i] - starts[i - 2]).total_seconds() >= 1.0 - 0.01


def test_rate_limit_refuses_past_the_limit_and_writes_nothing(durable):
    wf = durable.workflow("remind", rate_limit={"limit": 2, "period": 3600, "key": "user:{user}"})

    @wf.step
    def send(user):
        return user

    assert durable.start("remind", {"user": 1}) != durable.start("remind", {"user": 1})
    with pytest.raises(RateLimited) as refused:
        durable.start("remind", {"user": 1})
    assert 3590 < refused.value.retry_after <= 3600
    assert refused.value.key == "user:1"
    assert _count_runs(durable, "remind") == 2
    durable.start("remind", {"user": 2})  # another key has its own budget
    assert _count_runs(durable, "remind") == 3


def test_a_duplicate_answered_by_the_holder_counts_against_no_limit(durable):
    wf = durable.workflow("invoice", key="inv:{n}", rate_limit={"limit": 1, "period": 3600})

    @wf.step
    def bill(n):
        return n

    first = durable.start("invoice", {"n": 1})
    assert durable.start("invoice", {"n": 1}) == first  # use_existing: the holder answers
    with pytest.raises(RateLimited):
        durable.start("invoice", {"n": 2})
    assert _count_runs(durable, "invoice") == 1
    assert durable.list_runs(workflow="invoice")[0].key == "inv:1"


@pytest.mark.parametrize("backend", ["postgres"])
def test_rate_limit_racing_from_many_threads_accepts_exactly_the_limit(durable):
    wf = durable.workflow("remind", rate_limit={"limit": 3, "period": 3600, "key": "user:{user}"})

    @wf.step
    def send(user):
        return user

    accepted, refused, errors = [], [], []
    barrier = threading.Barrier(12)

    def start() -> None:
        barrier.wait()
        try:
            accepted.append(durable.start("remind", {"user": 1}))
        except RateLimited as exc:
            refused.append(exc)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(accepted) == 3 and len(refused) == 9
    assert _count_runs(durable, "remind") == 3


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_rate_limited_inside_the_callers_transaction_leaves_it_usable(durable):
    from sqlalchemy import text

    wf = durable.workflow("remind", key="r:{user}", rate_limit={"limit": 1, "period": 3600})

    @wf.step
    def send(user):
        return user

    durable.start("remind", {"user": 1})
    with durable.db.engine.connect() as conn, conn.begin():
        with pytest.raises(RateLimited):
            durable.start("remind", {"user": 2}, connection=conn)
        assert conn.execute(text("SELECT 1")).scalar_one() == 1  # still usable
    assert _count_runs(durable, "remind") == 1
    assert [run.key for run in durable.list_runs(workflow="remind")] == ["r:1"]


@pytest.mark.parametrize("backend", ["memory"])
def test_a_fake_keeps_the_rules_on_its_own_clock(backend):
    from durable_celery.testing import Fake

    fake = Fake()
    try:
        begun: list[tuple[int, float]] = []
        t0 = fake.now()
        api = fake.workflow("api", throttle={"limit": 2, "period": 60, "key": "c:{customer}"})

        @api.step
        def call(customer, n):
            begun.append((n, (fake.now() - t0).total_seconds()))

        for n in range(5):
            fake.start("api", {"customer": "x", "n": n})
        for _ in range(6):
            fake.run_until_idle()
            fake.advance(30)
        assert begun == [(0, 0.0), (1, 0.0), (2, 60.0), (3, 60.0), (4, 120.0)]

        remind = fake.workflow("remind", rate_limit={"limit": 1, "period": 3600, "key": "u:{user}"})

        @remind.step
        def send(user):
            return user

        fake.start("remind", {"user": 1})
        fake.advance(600)
        with pytest.raises(RateLimited) as refused:
            fake.start("remind", {"user": 1})
        assert refused.value.retry_after == pytest.approx(3000, abs=0.01)
        fake.advance(3000.01)
        fake.start("remind", {"user": 1})
        assert len(fake.list_runs(workflow="remind")) == 2

        order: list[int] = []
        sync = fake.workflow("sync", concurrency={"limit": 1, "key": "{tenant}"})

        @sync.step
        def first(tenant, n):
            order.append(n)

        @sync.step
        def second(tenant, n):
            order.append(n)

        for n in range(3):
            fake.start("sync", {"tenant": "a", "n": n})
        fake.run_until_idle()
        assert order == [0, 0, 1, 1, 2, 2]
    finally:
        fake.close()


@pytest.mark.parametrize("backend", ["memory"])
def test_a_backend_told_it_lacks_flow_control_refuses_such_starts(backend):
    from durable_celery import Capability, Unsupported
    from durable_celery.testing import Fake

    fake = Fake(capabilities=Capability.ALL & ~Capability.FLOW_CONTROL)
    try:
        wf = fake.workflow("sync", concurrency={"limit": 1})

        @wf.step
        def go():
            return None

        with pytest.raises(Unsupported, match="missing FLOW_CONTROL"):
            fake.start("sync")
        assert fake.list_runs() == []
    finally:
        fake.close()


@pytest.mark.parametrize("backend", ["postgres", "memory"])
def test_the_options_work_on_decorated_workflows_and_a_key_may_be_a_callable(durable, monkeypatch):
    from durable_celery import definition, durable_workflow

    monkeypatch.setattr(definition, "_shared", [])  # the shared workflow stays this test's

    @durable.workflow(rate_limit={"limit": 1, "period": 3600, "key": lambda data: f"acct:{data['n'] % 2}"})
    def ping(n):
        return n

    suffix = uuid.uuid4().hex[:8]

    @durable_workflow(
        f"shared_{suffix}", concurrency={"limit": 1, "key": "{n}"}, throttle={"limit": 5, "period": 1}
    )
    def shared(n):
        return n

    assert ping.rate_limit.key is not None and shared.concurrency.limit == 1
    durable.start(ping, {"n": 1})
    durable.start(ping, {"n": 2})  # acct:0: a key of its own
    with pytest.raises(RateLimited) as refused:
        durable.start(ping, {"n": 3})  # acct:1 again
    assert refused.value.key == "acct:1"
    run_id = shared.start({"n": 7})
    with durable.db.engine.connect() as conn:
        row = conn.execute(
            select(runs.c.slot_key, runs.c.throttle_key, runs.c.rate_key).where(runs.c.id == run_id)
        ).one()
    assert tuple(row) == ("7", "", None)  # no throttle key: one window for the whole workflow
    with worker(durable):
        assert wait_for(durable, run_id, timeout=30).output == 7
