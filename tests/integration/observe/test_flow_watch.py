"""Watching flow control (observe/flow.py): each limit's use per key, one run's wait in words and
the flow gauges, with runs parked by a real worker or by the engine's own claim, on PostgreSQL,
the SQLite file and the in-memory store."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import select

from durable_celery.errors import InvalidArgument
from durable_celery.observe.flow import clock_words, explain_wait, flow_report, limit_words, use_words
from durable_celery.store.flow_reads import run_flow
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for, worker
from tests.conftest import EVERY_STORE

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=EVERY_STORE)
def backend(request: pytest.FixtureRequest) -> str:
    """PostgreSQL (with Redis), the embedded SQLite default and the in-memory store."""
    return str(request.param)


def until(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll ``check`` until it returns something true; TimeoutError naming ``what`` if not."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout}s")
        time.sleep(0.05)
    return found


def flow_rows_of(durable, run_ids):
    with durable.db.engine.connect() as conn:
        query = select(runs.c.id, runs.c.flow_wait, runs.c.locked_by).where(runs.c.id.in_(run_ids))
        return {row.id: row for row in conn.execute(query)}


def parked_for_slot(durable, run_ids, running: int):
    """The run ids parked for a slot, once ``running`` of the others are executing a step."""
    rows = flow_rows_of(durable, run_ids)
    parked = [i for i, r in rows.items() if r.flow_wait == "slot"]
    busy = [i for i, r in rows.items() if r.locked_by is not None]
    return parked if parked and len(busy) == running else None


def entry_of(report, workflow: str):
    (found,) = [e for e in report if e.workflow == workflow]
    return found


def key_use(entry, kind: str, key: str):
    (found,) = [k for k in entry.keys if k.kind == kind and k.key == key]
    return found


def test_a_worker_parks_a_run_for_a_slot_and_every_read_says_so(durable):
    go = threading.Event()
    wf = durable.workflow("sync", concurrency={"limit": 2, "key": "tenant:{tenant}"})

    @wf.step
    def fetch(tenant, n):
        assert go.wait(60), "the test never let the step go"

    a_runs = [durable.start("sync", {"tenant": "A", "n": n}) for n in range(3)]
    b_run = durable.start("sync", {"tenant": "B", "n": 9})
    metrics = durable.metrics
    try:
        with worker(durable, concurrency=4):
            (parked,) = until(
                "a run of A parked behind two running", lambda: parked_for_slot(durable, a_runs, 2)
            )
            until("B's run running", lambda: flow_rows_of(durable, [b_run])[b_run].locked_by)
            with durable.db.engine.connect() as conn:
                row = run_flow(conn, parked)
            assert (
                explain_wait(durable.runtime, row)
                == "waiting for a concurrency slot (tenant:A, 2 of 2 in use)"
            )

            entry = entry_of(flow_report(durable.runtime), "sync")
            assert entry.limits == {"concurrency": {"limit": 2, "key": "tenant:{tenant}"}}
            assert limit_words("concurrency", entry.limits["concurrency"]) == "2 at once per tenant:{tenant}"
            assert [(k.kind, k.key) for k in entry.keys] == [
                ("concurrency", "tenant:A"),
                ("concurrency", "tenant:B"),
            ]
            a, b = key_use(entry, "concurrency", "tenant:A"), key_use(entry, "concurrency", "tenant:B")
            assert (a.used, a.limit, a.waiting) == (2, 2, 1)
            assert a.oldest_waiting == durable.get_run(parked).created_at
            assert use_words(a) == "2 of 2 in use"
            assert (b.used, b.waiting, b.oldest_waiting) == (1, 0, None)

            assert metrics.value("durable_flow_waiting", {"workflow": "sync", "wait": "slot"}) == 1
            assert metrics.value("durable_flow_waiting", {"workflow": "sync", "wait": "throttle"}) is None
            assert metrics.value("durable_flow_slots_in_use", {"workflow": "sync"}) == 3
            go.set()
            for run_id in [*a_runs, b_run]:
                assert wait_for(durable, run_id, timeout=60).status == "completed"
    finally:
        go.set()
    assert entry_of(flow_report(durable.runtime), "sync").keys == []
    assert metrics.value("durable_flow_waiting", {"workflow": "sync", "wait": "slot"}) == 0
    assert metrics.value("durable_flow_slots_in_use", {"workflow": "sync"}) == 0


def test_a_limit_for_the_whole_workflow_is_explained_without_a_key(durable):
    entered, go = threading.Event(), threading.Event()
    wf = durable.workflow("export", concurrency={"limit": 1})

    @wf.step
    def write(n):
        entered.set()
        assert go.wait(60), "the test never let the step go"

    first, second = durable.start("export", {"n": 1}), durable.start("export", {"n": 2})
    step = wf.steps[0]
    runner = threading.Thread(target=durable.engine.execute, args=(wf, step, first, False))
    runner.start()
    try:
        assert entered.wait(30)
        assert durable.engine.execute(wf, step, second, False) == "dropped"  # parked for the slot
        with durable.db.engine.connect() as conn:
            row = run_flow(conn, second)
        assert row.flow_wait == "slot"
        text = explain_wait(durable.runtime, row)
        assert text == "waiting for a concurrency slot (the whole workflow, 1 of 1 in use)"
        (use,) = entry_of(flow_report(durable.runtime), "export").keys
        assert (use.key, use.used, use.waiting) == ("", 1, 1)
    finally:
        go.set()
        runner.join(30)
    assert durable.get_run(first).status == "completed"


def test_a_throttled_run_says_until_when_and_the_report_shows_the_window(durable):
    wf = durable.workflow("api", throttle={"limit": 2, "period": 60, "key": "api:{customer}"})

    @wf.step
    def call(customer, n):
        return n

    ids = [durable.start("api", {"customer": "c1", "n": n}) for n in range(3)]
    other = durable.start("api", {"customer": "c2", "n": 0})
    step = wf.steps[0]
    assert [durable.engine.execute(wf, step, run_id, False) for run_id in ids] == [
        "completed",
        "completed",
        "dropped",
    ]
    with durable.db.engine.connect() as conn:
        row = run_flow(conn, ids[2])
    assert row.flow_wait == "throttle"
    first_begun = durable.get_run(ids[0]).started_at
    due = durable.get_run(ids[2])  # due when the first begin leaves the window
    text = explain_wait(durable.runtime, row)
    looks_again = row.due_at if row.due_at.tzinfo else row.due_at.replace(tzinfo=first_begun.tzinfo)
    assert 59 <= (looks_again - first_begun).total_seconds() <= 61, (looks_again, first_begun)
    until = clock_words(looks_again, durable.db.utcnow())
    assert text == f"throttled until {until} (api:c1, 2 began in the last 60 s)"
    assert due.status == "pending"

    entry = entry_of(flow_report(durable.runtime), "api")
    assert [(k.kind, k.key) for k in entry.keys] == [("throttle", "api:c1"), ("throttle", "api:c2")]
    c1, c2 = key_use(entry, "throttle", "api:c1"), key_use(entry, "throttle", "api:c2")
    assert (c1.used, c1.limit, c1.period, c1.waiting) == (2, 2, 60.0, 1)
    assert c1.next_look == looks_again and c1.oldest_waiting == durable.get_run(ids[2]).created_at
    assert use_words(c1) == "2 of 2 begun in 60s"
    assert (c2.used, c2.waiting, c2.next_look) == (0, 0, None)
    assert limit_words("throttle", entry.limits["throttle"]) == "2 begins per 60s per api:{customer}"
    assert durable.metrics.value("durable_flow_waiting", {"workflow": "api", "wait": "throttle"}) == 1
    assert durable.metrics.value("durable_flow_waiting", {"workflow": "api", "wait": "slot"}) is None
    assert durable.get_run(other).status == "pending"


def test_rate_limits_show_the_starts_in_the_window_per_key(durable):
    wf = durable.workflow("remind", rate_limit={"limit": 2, "period": 3600, "key": "user:{user}"})
    plain = durable.workflow("plain")
    for w in (wf, plain):
        w.step(lambda **data: None, name="send")

    durable.start("remind", {"user": 1})
    durable.start("remind", {"user": 1})
    durable.start("remind", {"user": 2})
    report = flow_report(durable.runtime)
    assert [e.workflow for e in report] == ["remind"]  # a workflow without limits is not listed
    entry = report[0]
    assert limit_words("rate_limit", entry.limits["rate_limit"]) == "2 starts per 3600s per user:{user}"
    one, two = key_use(entry, "rate_limit", "user:1"), key_use(entry, "rate_limit", "user:2")
    assert [k.key for k in entry.keys] == ["user:1", "user:2"]  # busiest first
    assert (one.used, one.limit, two.used, two.until) == (2, 2, 1, None)
    assert use_words(one) == "2 of 2 started in 3600s"
    oldest = min(r.created_at for r in durable.list_runs(workflow="remind") if r.input == {"user": 1})
    assert one.until is not None and 3599 <= (one.until - oldest).total_seconds() <= 3601
    assert flow_report(durable.runtime, keys=1)[0].keys == [one]


def test_an_unknown_workflow_or_a_bad_bound_is_refused(durable):
    durable.workflow("sync", concurrency={"limit": 1}).step(lambda: None, name="only")
    with pytest.raises(InvalidArgument, match="no workflow 'nope' is defined here"):
        flow_report(durable.runtime, "nope")
    with pytest.raises(InvalidArgument, match="keys must be a positive int"):
        flow_report(durable.runtime, keys=0)
    assert [e.workflow for e in flow_report(durable.runtime, "sync")] == ["sync"]


def test_a_fair_limit_shows_each_fair_keys_share_and_the_held_priorities(durable):
    go, entered = threading.Event(), threading.Event()
    limit = {"limit": 1, "fair": "t:{tenant}", "weights": {"t:gold": 3}}
    wf = durable.workflow("fair", concurrency=limit)

    @wf.step
    def work(tenant, n):
        entered.set()
        assert go.wait(60), "the test never let the step go"

    holder = durable.start("fair", {"tenant": "gold", "n": 0})
    runner = threading.Thread(target=durable.engine.execute, args=(wf, wf.steps[0], holder, False))
    runner.start()
    metrics = durable.metrics
    try:
        assert entered.wait(30)
        for run_id in [durable.start("fair", {"tenant": "gold", "n": n}) for n in (1, 2)]:
            assert durable.engine.execute(wf, wf.steps[0], run_id, False) == "dropped"
        durable.start("fair", {"tenant": "free", "n": 1})  # parked at its start: runs wait already
        urgent = durable.start("fair", {"tenant": "free", "n": 2}, priority=2)
        assert flow_rows_of(durable, [urgent])[urgent].flow_wait == "slot"
        entry = entry_of(flow_report(durable.runtime), "fair")
        assert entry.limits["concurrency"] == {
            "limit": 1,
            "key": None,
            "fair": "t:{tenant}",
            "weights": {"t:gold": 3.0},
        }
        shares = [(f.key, f.weight, f.in_use, f.share, f.waiting) for f in entry.fair]
        assert shares == [("t:free", 1.0, 0, 0.0, 2), ("t:gold", 3.0, 1, 1.0, 2)]
        assert entry.fair[0].oldest_waiting is not None
        assert entry.priorities == {0: 3, 2: 1}
        assert metrics.value("durable_flow_fair_in_use", {"workflow": "fair", "fair_key": "t:gold"}) == 1
        assert metrics.value("durable_flow_fair_waiting", {"workflow": "fair", "fair_key": "t:free"}) == 2
    finally:
        go.set()
        runner.join(30)


def test_open_batches_show_their_key_items_and_when_they_close(durable):
    wf = durable.workflow("invoice", batch={"max": 5, "period": 60, "key": "invoice:{customer}"})
    wf.step(lambda items: len(items), name="bill")
    durable.workflow("plain").step(lambda: None, name="only")
    assert durable.metrics.value("durable_batches_open", {"workflow": "invoice"}) == 0
    first = durable.start("invoice", {"customer": 1})
    durable.start("invoice", {"customer": 1})
    second = durable.start("invoice", {"customer": 2})
    (entry,) = flow_report(durable.runtime)  # a workflow without limits or batch is not listed
    assert entry.workflow == "invoice"
    assert entry.limits == {"batch": {"max": 5, "period": 60.0, "key": "invoice:{customer}"}}
    shown = [(b.key, b.run_id, b.items, b.max) for b in entry.batches]
    assert sorted(shown) == [("invoice:1", first, 2, 5), ("invoice:2", second, 1, 5)]
    for batch in entry.batches:
        assert 59 <= (batch.closes_at - batch.opened_at).total_seconds() <= 61
    assert durable.metrics.value("durable_batches_open", {"workflow": "invoice"}) == 2
    assert durable.metrics.value("durable_batch_items", {"workflow": "invoice"}) == 3
