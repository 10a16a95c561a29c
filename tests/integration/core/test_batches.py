"""Batches (core/batches.py): a workflow's ``batch={"max", "period", "key"}`` gathers its starts
by batch key into one run whose steps get ``items=[...]``; on PostgreSQL, the SQLite file and the
in-memory store, with real workers."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from durable_celery import InvalidDefinition, InvalidStart
from durable_celery.errors import RateLimited, RunNotFound
from durable_celery.store.schema import batches, runs
from durable_celery.testing import wait_for, worker
from tests.conftest import EVERY_STORE

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=EVERY_STORE)
def backend(request: pytest.FixtureRequest) -> str:
    """PostgreSQL, the embedded SQLite default, and the in-memory store."""
    return str(request.param)


def _define(durable, name="invoice", seen=None, **batch):
    wf = durable.workflow(name, batch={"max": 3, "period": 60, "key": "invoice:{customer}", **batch})

    @wf.step
    def bill(items):
        if seen is not None:
            seen.append([item["n"] for item in items])
        return sum(item["n"] for item in items)

    return wf


def _open(durable):
    with durable.db.engine.connect() as conn:
        return {row.batch_key: (row.run_id, row.items) for row in conn.execute(select(batches))}


def test_starts_with_one_batch_key_go_into_one_run_in_start_order(durable):
    _define(durable)
    first = durable.start("invoice", {"customer": 7, "n": 1})
    other = durable.start("invoice", {"customer": 8, "n": 10})
    assert durable.start("invoice", {"customer": 7, "n": 2}) == first
    assert other != first
    run = durable.get_run(first)
    assert run.status == "pending" and run.batch_key == "invoice:7" and run.started_at is None
    assert run.input == {"items": [{"customer": 7, "n": 1}, {"customer": 7, "n": 2}]}
    assert _open(durable) == {"invoice:7": (first, 2), "invoice:8": (other, 1)}
    # The batch is open for 60 s: its run is not due, a worker leaves it alone.
    with worker(durable):
        time.sleep(0.5)
        assert durable.get_run(first).status == "pending"


def test_the_max_th_start_fills_the_batch_its_run_goes_now_and_the_next_start_opens_another(durable):
    seen: list[list[int]] = []
    _define(durable, seen=seen)
    ids = [durable.start("invoice", {"customer": 1, "n": n}) for n in range(1, 8)]
    assert ids[0] == ids[1] == ids[2] and ids[3] == ids[4] == ids[5] and ids[6] not in ids[:6]
    assert len({ids[0], ids[3], ids[6]}) == 3
    assert _open(durable) == {"invoice:1": (ids[6], 1)}
    with worker(durable):
        done = [wait_for(durable, run_id, timeout=30) for run_id in (ids[0], ids[3])]
    assert [run.output for run in done] == [6, 15]
    assert sorted(seen) == [[1, 2, 3], [4, 5, 6]]
    assert durable.get_run(ids[6]).status == "pending"  # its period (60 s) is not over


def test_a_batch_closes_when_its_period_is_over_and_its_run_begins_then(durable):
    _define(durable, period=0.4)
    began = time.monotonic()
    run_id = durable.start("invoice", {"customer": 1, "n": 5})
    assert durable.start("invoice", {"customer": 1, "n": 6}) == run_id
    with worker(durable):
        run = wait_for(durable, run_id, timeout=30)
    assert run.status == "completed" and run.output == 11
    assert time.monotonic() - began >= 0.4
    assert (run.started_at - run.created_at).total_seconds() >= 0.35  # not before the period's end
    assert durable.start("invoice", {"customer": 1, "n": 7}) != run_id  # after it began: the next


def test_a_start_after_the_batch_run_began_opens_the_next_batch(durable):
    _define(durable)
    run_id = durable.start("invoice", {"customer": 1, "n": 1})
    with durable.db.begin() as conn:  # a worker claimed the run (its period cut short by hand)
        now = durable.db.utcnow()
        conn.execute(runs.update().where(runs.c.id == run_id).values(status="running", started_at=now))
    later = durable.start("invoice", {"customer": 1, "n": 2})
    assert later != run_id
    assert durable.get_run(run_id).input == {"items": [{"customer": 1, "n": 1}]}
    assert durable.get_run(later).input == {"items": [{"customer": 1, "n": 2}]}
    assert _open(durable) == {"invoice:1": (later, 1)}


def test_a_cancelled_batch_takes_no_more_starts(durable):
    _define(durable)
    run_id = durable.start("invoice", {"customer": 1, "n": 1})
    durable.cancel(run_id)
    later = durable.start("invoice", {"customer": 1, "n": 2})
    assert later != run_id and durable.get_run(run_id).input == {"items": [{"customer": 1, "n": 1}]}
    assert durable.get_run(later).status == "pending"


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_a_rolled_back_start_is_in_no_batch(durable):
    _define(durable)
    first = durable.start("invoice", {"customer": 1, "n": 1})
    with durable.db.engine.connect() as conn:
        with conn.begin() as tx:
            assert durable.start("invoice", {"customer": 1, "n": 2}, connection=conn) == first
            tx.rollback()
        with conn.begin() as tx:  # a rolled-back start that opened a batch leaves no run
            opened = durable.start("invoice", {"customer": 2, "n": 3}, connection=conn)
            tx.rollback()
    with pytest.raises(RunNotFound):
        durable.get_run(opened)
    with Session(durable.db.engine) as session:
        assert durable.start("invoice", {"customer": 1, "n": 4}, connection=session) == first
        session.commit()
    assert durable.get_run(first).input["items"] == [{"customer": 1, "n": 1}, {"customer": 1, "n": 4}]
    assert _open(durable) == {"invoice:1": (first, 2)}


def test_definition_and_start_errors_write_nothing(durable):
    bad = [
        ({"max": 1, "period": 5}, "max"),
        ({"max": 10}, "period"),
        ({"max": 10, "period": 0}, "period"),
        ({"max": 10, "period": 5, "size": 3}, "size"),
        ({"max": 10, "period": 5, "key": 3}, "key"),
        ("often", "dict"),
    ]
    for given, said in bad:
        with pytest.raises(InvalidDefinition, match=said):
            durable.workflow("bad", batch=given)
    with pytest.raises(InvalidDefinition, match="workflow key"):
        durable.workflow("bad", key="k:{customer}", batch={"max": 5, "period": 1})
    with pytest.raises(InvalidDefinition, match="debounce"):
        durable.workflow("bad", debounce={"period": 1}, batch={"max": 5, "period": 1})
    with pytest.raises(InvalidDefinition, match="required"):
        durable.workflow("bad", idempotency="required", batch={"max": 5, "period": 1})
    _define(durable)
    with pytest.raises(InvalidStart, match="takes no key"):
        durable.start("invoice", {"customer": 1, "n": 1}, key="mine")
    with pytest.raises(InvalidStart, match="customer"):
        durable.start("invoice", {"n": 1})
    plain = durable.workflow("plain_items", batch={"max": 2, "period": 1})

    @plain.step
    def needs(customer):
        return customer

    with pytest.raises(InvalidStart, match="items"):  # its steps get items=[...], not the input
        durable.start("plain_items", {"customer": 1})
    assert durable.list_runs() == [] and _open(durable) == {}


def test_a_rate_limit_counts_batch_runs_not_the_starts_they_gather(durable):
    wf = durable.workflow("limited", batch={"max": 3, "period": 60}, rate_limit={"limit": 1, "period": 60})

    @wf.step
    def bill(items):
        return len(items)

    ids = {durable.start("limited", {"n": n}) for n in range(3)}
    assert len(ids) == 1
    with pytest.raises(RateLimited):  # the batch is full: the next start would open a second run
        durable.start("limited", {"n": 3})
    assert [run.id for run in durable.list_runs()] == list(ids)


def test_flow_keys_come_from_the_first_start_and_a_concurrency_limit_holds_batch_runs(durable):
    spans: list[tuple[float, float]] = []
    wf = durable.workflow(
        "slow", batch={"max": 2, "period": 60, "key": "c:{c}"}, concurrency={"limit": 1, "key": "t:{t}"}
    )

    @wf.step
    def work(items):
        began = time.monotonic()
        time.sleep(0.2)
        spans.append((began, time.monotonic()))
        return len(items)

    ids = [durable.start("slow", {"c": n // 2, "t": "a", "n": n}) for n in range(6)]
    with durable.db.engine.connect() as conn:
        keys = set(conn.execute(select(runs.c.slot_key).where(runs.c.id.in_(ids))).scalars())
    assert keys == {"t:a"}
    with worker(durable, concurrency=3):
        done = [wait_for(durable, run_id, timeout=60) for run_id in dict.fromkeys(ids)]
    assert [run.output for run in done] == [2, 2, 2]
    spans.sort()
    assert all(
        earlier[1] <= later[0] for earlier, later in zip(spans, spans[1:], strict=False)
    )  # one at a time


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_thousand_starts_over_ten_keys_from_eight_threads_each_in_one_batch_exactly_once(durable):
    period, most = 1.0, 30
    seen: list[list[int]] = []
    _define(durable, seen=seen, period=period, max=most)
    started: dict[str, list[tuple[float, float]]] = defaultdict(list)
    lock, errors = threading.Lock(), []
    given = [(n % 10, n) for n in range(1000)]

    def produce(part):
        try:
            for customer, n in part:
                before = time.monotonic()
                run_id = durable.start("invoice", {"customer": customer, "n": n})
                with lock:
                    started[run_id].append((before, time.monotonic()))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with worker(durable, concurrency=2):
        threads = [threading.Thread(target=produce, args=(given[i::8],)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        done = [wait_for(durable, run_id, timeout=60) for run_id in started]
    assert all(run.status == "completed" for run in done)
    gathered = [item["n"] for run in done for item in run.input["items"]]
    assert Counter(gathered) == Counter(n for _, n in given)  # every input, exactly once
    assert sorted(map(sorted, seen)) == sorted(sorted(i["n"] for i in run.input["items"]) for run in done)
    for run in done:
        items = run.input["items"]
        assert 1 <= len(items) <= most
        assert (
            len({item["customer"] for item in items}) == 1
            and run.batch_key == f"invoice:{items[0]['customer']}"
        )
        times = started[run.id]
        assert len(times) == len(items)
        # Every start that joined began within the period of the first one's transaction (which
        # ended first: the others waited on the batch's row until it committed).
        assert max(begin for begin, _ in times) - min(end for _, end in times) < period
        # Its run began once the period was over or the batch full, plus the relay's pass (and
        # what a worker busy with other batches on two cores adds: generous, it is not a bench).
        waited = (run.started_at - run.created_at).total_seconds()
        assert waited <= period + durable.settings.poll_interval + 3.0


@pytest.mark.parametrize("backend", ["memory"])
def test_the_fake_gathers_batches_on_its_own_clock_and_one_told_it_lacks_flow_control_refuses(backend):
    from durable_celery import Capability, Unsupported
    from durable_celery.testing import Fake

    fake = Fake()
    try:
        _define(fake, period=30)
        run_id = fake.start("invoice", {"customer": 1, "n": 4})
        assert fake.start("invoice", {"customer": 1, "n": 5}) == run_id
        fake.run_until_idle()
        assert fake.get_run(run_id).status == "pending"  # its period is not over on the Fake's clock
        fake.advance(30)
        fake.run_until_idle()
        assert fake.get_run(run_id).output == 9
        assert fake.start("invoice", {"customer": 1, "n": 6}) != run_id
    finally:
        fake.close()
    refusing = Fake(capabilities=Capability.ALL & ~Capability.FLOW_CONTROL)
    try:
        _define(refusing)
        with pytest.raises(Unsupported, match="missing FLOW_CONTROL"):
            refusing.start("invoice", {"customer": 1, "n": 1})
        assert refusing.list_runs() == []
    finally:
        refusing.close()


def test_a_rerun_of_a_batch_run_takes_its_items_and_gathers_nothing(durable):
    seen: list[list[int]] = []
    _define(durable, seen=seen)
    run_id = durable.start("invoice", {"customer": 1, "n": 1})
    durable.start("invoice", {"customer": 1, "n": 2})
    durable.start("invoice", {"customer": 1, "n": 3})  # the third fills it: due now
    with worker(durable):
        assert wait_for(durable, run_id, timeout=30).output == 6
        again = durable.rerun(run_id)
        assert wait_for(durable, again, timeout=30).output == 6
    rerun = durable.get_run(again)
    assert rerun.input == durable.get_run(run_id).input and rerun.batch_key is None
    assert seen == [[1, 2, 3], [1, 2, 3]] and _open(durable) == {}
