"""Inline continuation: a worker runs a run's next step in the task execution that ran its step.

Messages are counted with Celery's ``before_task_publish`` signal; steps say which thread ran
them. Every wait polls a condition with a deadline. The last tests run the chain in this thread
(``run_message``): an outage met on the way, and the task events inline steps send. The tests
of messages also run on RabbitMQ (BROKERS_AND_SQLITE).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from celery.signals import before_task_publish

from durable_celery import current_run
from durable_celery.testing import wait_for, worker
from tests.conftest import BROKERS_AND_SQLITE
from tests.integration.core.helpers import answer_lost_once
from tests.integration.helpers import run_row

pytestmark = pytest.mark.timeout(90)
on_each_broker = pytest.mark.parametrize("backend", BROKERS_AND_SQLITE)


class Published:
    """The step tasks published while it is connected, by task name."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.names = prefix, []
        before_task_publish.connect(self.seen, weak=False)

    def seen(self, sender: str | None = None, **_: object) -> None:
        if sender and sender.startswith(self.prefix):
            self.names.append(sender)

    def close(self) -> None:
        before_task_publish.disconnect(self.seen)


@pytest.fixture
def published():
    made = []

    def watch(workflow: str) -> Published:
        made.append(Published(f"durable.{workflow}."))
        return made[-1]

    yield watch
    for p in made:
        p.close()


def chain_of(durable, name, count, *, queue_of=None, sleep=0.0, **options):
    """A workflow of ``count`` steps that note the thread they ran in."""
    ran = []
    wf = durable.workflow(name, **options)
    for i in range(count):

        def step(i=i):
            ran.append((i, threading.get_ident()))
            if sleep:
                time.sleep(sleep)
            return i

        wf.step(step, name=f"s{i}", queue=(queue_of or {}).get(i))
    return wf, ran


@on_each_broker
def test_a_three_step_run_is_one_message_and_one_execution(make_durable, published):
    durable = make_durable()
    wf, ran = chain_of(durable, "inline3", 3)
    sent = published("inline3")
    with worker(durable):
        run = wait_for(durable, durable.start(wf))
    assert run.status == "completed" and run.output == 2
    assert sent.names == ["durable.inline3.s0"]
    assert [i for i, _ in ran] == [0, 1, 2] and len({t for _, t in ran}) == 1
    records = durable.list_steps(run.id)
    assert [(s.name, s.status, s.attempt) for s in records] == [(f"s{i}", "completed", 1) for i in range(3)]


def test_inline_steps_zero_publishes_every_step(make_durable, published):
    durable = make_durable(inline_steps=0)
    wf, _ = chain_of(durable, "perstep", 3)
    sent = published("perstep")
    with worker(durable):
        assert wait_for(durable, durable.start(wf)).status == "completed"
    assert sent.names == ["durable.perstep.s0", "durable.perstep.s1", "durable.perstep.s2"]


@on_each_broker
def test_the_budget_publishes_after_inline_steps(make_durable, published):
    durable = make_durable(inline_steps=2)
    wf, ran = chain_of(durable, "budget6", 6)
    sent = published("budget6")
    with worker(durable):
        assert wait_for(durable, durable.start(wf)).status == "completed"
    assert sent.names == ["durable.budget6.s0", "durable.budget6.s3"]  # 1 + 2 inline, twice
    assert [i for i, _ in ran] == list(range(6))


def test_a_long_workflow_does_not_starve_others_on_its_queue(make_durable):
    durable = make_durable(inline_steps=3, inline_seconds=30)
    long, long_ran = chain_of(durable, "long", 40, sleep=0.01)
    short, short_ran = chain_of(durable, "short", 1)
    with worker(durable, concurrency=1):
        long_id = durable.start(long)
        until(lambda: len(long_ran) >= 1)  # the long run holds the only slot
        short_id = durable.start(short)
        assert wait_for(durable, short_id, timeout=30).status == "completed"
        done_when_short_ran = len(long_ran)
        assert wait_for(durable, long_id, timeout=60).status == "completed"
    # The short run's message got the slot after at most one budget (1 + 3 steps) more.
    assert done_when_short_ran <= 1 + 3 + 4, done_when_short_ran
    assert len(long_ran) == 40


@on_each_broker
def test_a_step_on_another_queue_is_published_there(make_durable, published):
    durable = make_durable()
    other = f"other-{uuid.uuid4().hex[:6]}"
    wf, ran = chain_of(durable, "hop", 3, queue_of={1: other, 2: other})
    sent = published("hop")
    with worker(durable, queues=[durable.app.conf.task_default_queue, other]):
        assert wait_for(durable, durable.start(wf)).status == "completed"
    assert sent.names == ["durable.hop.s0", "durable.hop.s1"]  # s2 shares s1's queue: inline
    assert [i for i, _ in ran] == [0, 1, 2]


@on_each_broker
def test_failure_wait_and_compensation_fall_back_to_messages(make_durable, published):
    durable = make_durable()
    undone = []
    wf = durable.workflow("mixed")

    @wf.step(compensate=lambda **_: undone.append("a"))
    def a():
        return "a"

    @wf.step
    def b():
        current_run().sleep(0.2)
        return "b"

    @wf.step(retry=2, backoff=0.1)
    def c():
        if current_run().attempt == 1:
            raise RuntimeError("first attempt fails")
        raise ValueError("and the second")

    sent = published("mixed")
    with worker(durable):
        run = wait_for(durable, durable.start(wf), timeout=30)
    assert run.status == "compensated" and undone == ["a"]
    steps = [(s.name, s.phase, s.status, s.attempt) for s in durable.list_steps(run.id)]
    assert steps == [
        ("a", "step", "completed", 1),
        ("b", "step", "completed", 1),
        ("c", "step", "failed", 1),
        ("c", "step", "failed", 2),
        ("a", "compensate", "completed", 1),
    ]
    # a, then b inline (it parks); b woken by a message; c inline after b; c's retry and the
    # compensation by messages (the relay or a publish), never inline.
    assert sent.names[0] == "durable.mixed.a" and "durable.mixed.c" in sent.names
    assert sent.names.count("durable.mixed.b") == 1


@on_each_broker
def test_a_paused_queue_stops_the_chain_and_its_resume_goes_on(make_durable):
    durable = make_durable()
    release = threading.Event()
    wf = durable.workflow("pausable")

    @wf.step
    def first():
        release.wait(10)

    @wf.step
    def second():
        return "second"

    default = durable.app.conf.task_default_queue
    with worker(durable):
        run_id = durable.start(wf)
        until(lambda: durable.stats.queues()[default]["running"] == 1)
        durable.pause_queue(default)
        release.set()
        until(lambda: durable.stats.queues()[default]["ready"] == 1)
        run = durable.get_run(run_id)
        assert run.status == "running" and run.step_index == 1  # recorded, not claimed
        assert [s.name for s in durable.list_steps(run_id)] == ["first"]
        durable.resume_queue(default)
        assert wait_for(durable, run_id).output == "second"


def test_only_a_pause_of_the_next_step_s_own_queue_stops_the_chain(make_durable, published):
    durable = make_durable()
    wf, ran = chain_of(durable, "unpaused", 3)
    default = durable.app.conf.task_default_queue
    durable.pause_queue(f"elsewhere-{uuid.uuid4().hex[:6]}")  # another queue is paused
    durable.pause_queue(default)
    durable.resume_queue(default)  # this one was, and is no more
    sent = published("unpaused")
    with worker(durable):
        run_id = durable.start(wf)
        assert wait_for(durable, run_id).status == "completed"
    assert sent.names == ["durable.unpaused.s0"]  # one message: every next step ran inline
    assert len({thread for _, thread in ran}) == 1


def test_an_inline_claim_takes_the_lock_under_a_new_fence_with_no_message_marks(make_durable):
    from sqlalchemy import select

    from durable_celery.store.schema import runs

    durable = make_durable()
    seen = []
    wf = durable.workflow("marks")

    def look():
        with durable.db.engine.connect() as conn:
            seen.append(conn.execute(select(runs).where(runs.c.id == current_run().id)).one())

    wf.step(look, name="first")
    wf.step(look, name="second")
    with worker(durable):
        assert wait_for(durable, durable.start(wf)).status == "completed"
    first, second = seen
    assert (second.step_index, second.fence, second.attempt) == (1, first.fence + 1, 1)
    assert (second.resends, second.resend_at, second.published, second.due_at) == (0, None, False, None)
    assert second.locked_by == first.locked_by and second.heartbeat_at is not None


def test_an_inline_step_is_fenced_like_a_published_one(make_durable):
    """The next step's claim moves the fence: a write under the old fence records nothing."""
    durable = make_durable()
    entered, release = threading.Event(), threading.Event()
    wf = durable.workflow("fenced")

    @wf.step
    def first():
        return 1

    @wf.step
    def second():
        entered.set()
        release.wait(10)
        return 2

    from durable_celery.store import queries

    with worker(durable):
        run_id = durable.start(wf)
        until(entered.is_set)
        with durable.db.engine.connect() as conn:
            held = queries.run_held_by(conn, run_id, "")
        assert held.step_index == 1 and held.fence == 2  # claimed twice: s0, then s1 inline
        # The first step's stale holder (fence 1) can no longer write anything.
        with durable.db.begin() as conn:
            assert not queries.heartbeat_run(durable.db, conn, run_id, 1, held.locked_by)
        release.set()
        assert wait_for(durable, run_id).output == 2


def until(check, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# -- in this thread: an outage met by the chain, task events of inline steps --------------------


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "not-committed"])
def test_an_inline_chain_goes_on_after_an_outage_interrupted_a_write(durable, monkeypatch, seen, commit):
    """Guards mutants of durable_celery/core/engine.py that the tests above let through.

    The first step runs through the engine in this thread; the outage hits its record (or its
    claim of the next step), and the chain still goes on inline."""
    from durable_celery.core import continuation

    wf = durable.workflow("chained")
    ran: list[int] = []
    for i in range(3):
        wf.step(lambda i=i: ran.append(i) or i, name=f"s{i}")
    run_id = durable.start(wf)
    if commit:  # the record (and its claim of the next step) committed, its answer lost
        from durable_celery import DatabaseUnavailable

        real, failed = continuation.claimed, []

        def claimed(row: Any, go_on: Any) -> None:
            if not failed:
                failed.append(1)
                raise DatabaseUnavailable("postgresql://db", "connection lost")
            real(row, go_on)

        monkeypatch.setattr(continuation, "claimed", claimed)
    else:
        failed = answer_lost_once(monkeypatch, durable, commit)  # the first step's record
    seen.published.clear()

    queue = run_row(durable, run_id).queue
    assert durable.engine.run_message(wf, wf.steps[0], run_id, False, queue).status == "running"

    assert failed == [1] and ran == [0, 1, 2]  # the next steps ran inline, in this call
    assert seen.published == []
    run = durable.get_run(run_id)
    assert (run.status, run.output) == ("completed", 2)
    steps = [(s.name, s.attempt, s.status) for s in durable.list_steps(run_id)]
    assert steps == [("s0", 1, "completed"), ("s1", 1, "completed"), ("s2", 1, "completed")]


def _task_events_of_a_message(durable: Any, run_id: str) -> list[str]:
    """Hand the run's first step message to its Celery task in this process (as a worker on the
    test's queue would) and return the types of the task events sent meanwhile."""
    return [event["type"] for event in _task_event_bodies_of_a_message(durable, run_id)]


def _task_event_bodies_of_a_message(durable: Any, run_id: str) -> list[dict[str, Any]]:
    """As above, the events themselves."""
    import uuid

    from celery.events.event import get_exchange
    from kombu import Consumer, Queue

    workflow = durable.workflows["evented"]
    events: list[dict[str, Any]] = []

    def note(body: Any, message: Any) -> None:
        events.extend(body if isinstance(body, list) else [body])

    def drain(conn: Any, seconds: float) -> None:
        try:
            while True:
                conn.drain_events(timeout=seconds)
        except TimeoutError:
            pass

    with durable.app.connection_for_read() as conn:
        exchange = get_exchange(conn, name=durable.app.conf.event_exchange)  # fanout on Redis, topic on AMQP
        watch = Queue(f"events-{uuid.uuid4().hex[:8]}", exchange, routing_key="task.#", auto_delete=True)
        with Consumer(conn, queues=[watch], callbacks=[note], no_ack=True, accept=["json"]):
            drain(conn, 0.2)  # subscribed before the step runs
            task = durable.app.tasks[workflow.steps[0].task_name]
            task.apply(kwargs={"run_id": run_id}, routing_key=durable.app.conf.task_default_queue)
            drain(conn, 0.5)
    return events


@on_each_broker
def test_a_durable_sends_no_task_events_for_inline_steps_until_its_worker_says_it_sends_them(durable):
    """Guards mutants of durable_celery/core/engine.py that the tests above let through.

    Outside a worker (or before its bootstep notes ``-E``), inline steps send no task
    events; once the worker sends them, the inline step shows as a task of its own."""
    wf = durable.workflow("evented")
    wf.step(lambda: 1, name="first")
    wf.step(lambda: 2, name="second")
    quiet = durable.start(wf)
    assert _task_events_of_a_message(durable, quiet) == []
    assert durable.get_run(quiet).status == "completed"  # the second step ran inline
    durable.engine.task_events.value = 1
    shown = durable.start(wf)
    assert _task_events_of_a_message(durable, shown)[:2] == ["task-received", "task-started"]
    assert durable.get_run(shown).status == "completed"


@on_each_broker
def test_each_inline_step_shows_as_a_task_of_its_own_that_succeeded_with_what_came_next(durable):
    """Guards mutants of durable_celery/core/engine.py: what an inline step came to reaches its
    task events (received, started, succeeded, with the step it went on to or how the run ended)."""
    wf = durable.workflow("evented")
    for name in ("first", "second", "third"):
        wf.step(lambda name=name: name, name=name)
    durable.engine.task_events.value = 1
    run_id = durable.start(wf)

    events = _task_event_bodies_of_a_message(durable, run_id)

    assert durable.get_run(run_id).status == "completed"
    assert [e["type"] for e in events] == ["task-received", "task-started", "task-succeeded"] * 2
    second, third = events[:3], events[3:]
    assert [e["uuid"] for e in second] == [second[0]["uuid"]] * 3 != [third[0]["uuid"]] * 3
    assert [e["uuid"] for e in third] == [third[0]["uuid"]] * 3
    assert (second[0]["name"], third[0]["name"]) == (wf.steps[1].task_name, wf.steps[2].task_name)
    assert run_id in second[0]["kwargs"] and "second" in second[0]["kwargs"]
    assert second[2]["result"] == repr({"run_id": run_id, "step": "second", "next": "third"})
    assert third[2]["result"] == repr({"run_id": run_id, "step": "third", "run": "completed"})


def test_a_limited_runs_inline_chain_keeps_its_slot_until_its_last_step_ends(durable):
    """Guards mutants of durable_celery/core/engine.py: a run that goes on inline holds its
    concurrency slot from step to step, and frees it for the run parked behind it when the
    chain ends in this call."""
    wf = durable.workflow("limited_chain", concurrency={"limit": 1, "key": "{tenant}"})
    runs: dict[str, str] = {}
    parked: list[str] = []

    def park_the_other() -> None:  # from another thread, as another worker's message would
        parked.append(durable.engine.execute(wf, wf.steps[0], runs["b"], False))

    @wf.step
    def first(tenant):
        if current_run().id == runs["a"]:
            other = threading.Thread(target=park_the_other)
            other.start()
            other.join(20)

    @wf.step
    def second(tenant):
        parked.append(run_row(durable, runs["b"]).flow_wait)

    runs["a"] = durable.start(wf, {"tenant": "t"})
    runs["b"] = durable.start(wf, {"tenant": "t"})
    queue = run_row(durable, runs["a"]).queue

    result = durable.engine.run_message(wf, wf.steps[0], runs["a"], False, queue)

    assert result.status == "running"  # the message's own step; the chain went on inline
    assert durable.get_run(runs["a"]).status == "completed"
    assert parked == ["dropped", "slot"]  # b parked, and still parked while a's second step ran
    assert run_row(durable, runs["b"]).flow_wait is None  # woken when a's chain ended
