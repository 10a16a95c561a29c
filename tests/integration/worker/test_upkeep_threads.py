"""The upkeep threads (``Upkeep``), driven in this process with short intervals: what each
thread does and how often, seen in the database, waiting on conditions with deadlines. ``Paced``
notes each wait of each thread, which is how a test counts a thread's passes (and reads its
backoff without waiting it out). Messages are recorded instead of sent.

Written against mutants of durable_celery/worker/upkeep.py that the behaviour tests (real
workers only) let through."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import delete, event, select, update

from durable_celery.core import prune, queues
from durable_celery.store import activity_rows, event_rows
from durable_celery.store.schema import activity, nodes, queue_samples, runs
from durable_celery.testing import RecordingOutbox
from durable_celery.worker import upkeep
from durable_celery.worker.relay import BrokerDown
from tests.integration.helpers import ago, run_row, set_run, set_waiting, two_step_workflow
from tests.integration.worker.helpers import THREADS, find_node, running_upkeep, until, upkeep_threads

pytestmark = pytest.mark.timeout(60)


class Paced(upkeep.Upkeep):
    """An Upkeep that notes every wait of every thread (one per pass) and cuts the waits of the
    threads in ``fast`` to a hundredth of a second (the noted value stays what it meant)."""

    def __init__(self, durable: Any, worker: Any = None, fast: tuple[str, ...] = ()) -> None:
        super().__init__(durable.runtime, durable.engine, durable.app, worker)
        self.waits: dict[str, list[float]] = defaultdict(list)
        self.fast = fast

    def _wait(self, seconds: float) -> bool:
        name = threading.current_thread().name
        self.waits[name].append(seconds)
        return super()._wait(0.01 if name in self.fast else seconds)

    def passes(self, thread: str) -> int:
        return len(self.waits[thread])


def _exists(durable: Any, run_id: str) -> bool:
    with durable.db.engine.connect() as conn:
        return conn.execute(select(runs.c.id).where(runs.c.id == run_id)).first() is not None


def _missed_wakeup(durable: Any, run_id: str) -> None:
    set_waiting(durable, run_id)
    with durable.db.begin() as conn:  # kept for it, but its wake-up was never sent
        event_rows.insert_event_txn(durable.db, conn, run_id, "paid", None)


# -- what the threads do ------------------------------------------------------------------------


def test_the_sweeper_fails_overdue_runs_every_pass_and_sweeps_once_a_sweep_interval(
    make_durable, monkeypatch
):
    # The first sweep comes after min(sweep_interval, stale_lock_timeout), the next a whole
    # sweep_interval (a minute) later; an overdue run fails at the next pass.
    outbox = RecordingOutbox()
    durable = make_durable(poll_interval=0.05, stale_lock_timeout=0.6, sweep_interval=60.0, outbox=outbox)
    wf = two_step_workflow(durable)
    overdue, stale, missed, parent, child = (durable.start(wf, {"n": n}) for n in range(5))
    set_run(durable, overdue, deadline_at=ago(durable, 1))
    lock = {"locked_by": "gone:1:1", "heartbeat_at": ago(durable, 3600), "started_at": ago(durable, 3600)}
    set_run(durable, stale, status="running", **lock)
    _missed_wakeup(durable, missed)
    set_run(durable, parent, status="cancelled", finished_at=durable.db.utcnow())
    set_run(durable, child, parent_id=parent)
    keeper = Paced(durable)
    began = time.monotonic()
    with running_upkeep(keeper):
        until(lambda: run_row(durable, overdue).status == "failed", "overdue run failed")
        until(lambda: run_row(durable, missed).due_at is not None, "missed wake-up done")
        assert time.monotonic() - began >= 0.6  # the first sweep: not before min(60, 0.6) s
        # The same sweep handed the stale run back (a node that has seen the database since it
        # started may sweep at once) and cancelled the cancelled parent's child.
        assert run_row(durable, stale).locked_by is None
        assert run_row(durable, child).status == "cancelled"
        until(lambda: {stale, missed} <= set(outbox.run_ids()), "the relay sending the runs due again")

        late_overdue, late_missed = (durable.start(wf, {"n": n}) for n in (5, 6))
        set_run(durable, late_overdue, deadline_at=ago(durable, 1))
        _missed_wakeup(durable, late_missed)
        passes = keeper.passes("durable-sweeper")
        until(lambda: run_row(durable, late_overdue).status == "failed", "late overdue run failed")
        until(lambda: keeper.passes("durable-sweeper") >= passes + 5, "five more sweeper passes")
        assert run_row(durable, late_missed).due_at is None  # the next sweep is a minute away
    assert durable.list_nodes() == []  # an Upkeep outside a worker is no node


def test_stale_locks_are_swept_only_once_the_database_was_seen_for_the_whole_timeout(durable):
    keeper = upkeep.Upkeep(durable.runtime, durable.engine, durable.app)
    timeout = durable.settings.stale_lock_timeout
    keeper.db_seen_since = None  # away now
    assert keeper.may_sweep_stale() is False
    keeper.db_seen_since = time.monotonic()  # just came back
    assert keeper.may_sweep_stale() is False
    keeper.db_seen_since = time.monotonic() - timeout - 1
    assert keeper.may_sweep_stale() is True


def test_the_database_counts_as_seen_from_the_first_pass_that_reaches_it(durable):
    keeper = upkeep.Upkeep(durable.runtime, durable.engine, durable.app)
    assert keeper.db_seen_since == -float("inf")  # a node that starts has not seen it missing
    keeper._observe(True)
    assert keeper.db_seen_since == -float("inf")
    keeper._observe(False)
    assert keeper.db_seen_since is None and keeper.may_sweep_stale() is False
    before = time.monotonic()
    keeper._observe(True)
    since = keeper.db_seen_since
    assert since is not None and before <= since <= time.monotonic()
    keeper._observe(True)
    assert keeper.db_seen_since == since  # seen without a break since then


def test_a_failing_job_is_logged_once_and_tried_again_and_stale_locks_wait_out_the_timeout_after(
    make_durable, caplog
):
    # The sweeper's statements fail for a while (its database is away); then they work again.
    durable = make_durable(poll_interval=0.05, stale_lock_timeout=1.0, sweep_interval=0.2)
    wf = two_step_workflow(durable)
    overdue, stale = (durable.start(wf, {"n": n}) for n in range(2))
    set_run(durable, overdue, deadline_at=ago(durable, 1))
    set_run(durable, stale, status="running", locked_by="gone:1:1", heartbeat_at=ago(durable, 3600))
    away = threading.Event()
    away.set()

    def refuse(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if away.is_set() and threading.current_thread().name == "durable-sweeper":
            raise ConnectionError("the database is away")

    keeper = Paced(durable)
    event.listen(durable.db.engine, "before_cursor_execute", refuse)
    try:
        with caplog.at_level(logging.DEBUG, logger="durable_celery"), running_upkeep(keeper):
            until(lambda: keeper.passes("durable-sweeper") >= 8, "eight sweeper passes")  # sweeps too
            assert run_row(durable, overdue).status == "pending" and keeper.db_seen_since is None
            away.clear()
            back = time.monotonic()
            until(lambda: run_row(durable, overdue).status == "failed", "the overdue run failed")
            until(lambda: run_row(durable, stale).locked_by is None, "the stale run handed back")
            assert time.monotonic() - back >= 1.0  # the whole stale_lock_timeout after it came back
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", refuse)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "fail_overdue_once" in r.getMessage()]
    assert said[0] == ("ERROR", "durable upkeep: fail_overdue_once failed (logged once until it works again)")
    assert {level for level, _ in said[1:-1]} == {"DEBUG"} and len(said) >= 4
    assert said[-1] == ("WARNING", "durable upkeep: fail_overdue_once works again")


def test_a_nodes_row_is_written_afresh_at_start_and_beaten_about_once_a_second(make_durable):
    durable = make_durable(poll_interval=0.05)  # heartbeat_interval 0.3 s: a node beats at most once a second
    host = SimpleNamespace(hostname="beating@test")
    last_life = upkeep.Upkeep(durable.runtime, durable.engine, durable.app, host)
    last_life._register_node()
    last_life.mark_draining()
    with durable.db.begin() as conn:
        hour_ago = ago(durable, 3600)
        conn.execute(
            update(nodes).where(nodes.c.name == "beating@test").values(started_at=hour_ago, seen_at=hour_ago)
        )
    old = find_node(durable, "beating@test")
    assert old is not None and old["draining"] is True
    keeper = upkeep.Upkeep(durable.runtime, durable.engine, durable.app, host)
    seen: list[Any] = []  # the row's seen_at since the start, as it changed

    def beaten_a_second_after_the_start() -> bool:
        node = find_node(durable, "beating@test")
        assert node is not None
        if node["draining"] or node["started_at"] == old["started_at"]:  # not registered afresh yet
            return False
        if not seen or seen[-1] != node["seen_at"]:
            seen.append(node["seen_at"])
        return (node["seen_at"] - node["started_at"]).total_seconds() >= 0.9

    with running_upkeep(keeper):
        until(beaten_a_second_after_the_start, "a beat a second after the start")
    node = find_node(durable, "beating@test")
    assert node is not None and node["draining"] is False and node["pid"] == os.getpid()
    assert node["queues"] == [durable.app.conf.task_default_queue]
    started = node["started_at"]
    # Registered afresh at the start, beaten at the sweeper's first pass, then a second later.
    assert len([at for at in seen if (at - started).total_seconds() < 0.9]) <= 2, seen
    assert (seen[-1] - started).total_seconds() < 1.6, seen


def test_a_stopping_worker_shows_its_node_as_draining(durable):
    from types import SimpleNamespace

    keeper = upkeep.Upkeep(
        durable.runtime, durable.engine, durable.app, SimpleNamespace(hostname="leaving@test")
    )
    other = upkeep.Upkeep(
        durable.runtime, durable.engine, durable.app, SimpleNamespace(hostname="staying@test")
    )
    keeper._register_node()
    other._register_node()
    keeper.mark_draining()
    draining = {n["name"]: n["draining"] for n in durable.list_nodes()}
    assert draining == {"leaving@test": True, "staying@test": False}
    upkeep.Upkeep(
        durable.runtime, durable.engine, durable.app
    ).mark_draining()  # no worker, no node: nothing to mark


class _Consumer:
    """What a node's reconcile uses of a worker's consumer; its loop's call_soon runs at once."""

    def __init__(self) -> None:
        self.task_consumer = object()
        self.calls: list[tuple[str, str]] = []

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def cancel_task_queue(self, queue: str) -> None:
        self.calls.append(("cancel", queue))

    def add_task_queue(self, queue: str) -> None:
        self.calls.append(("add", queue))


def test_the_relay_thread_stops_consuming_a_paused_queue_and_consumes_it_again_once_resumed(make_durable):
    durable = make_durable(poll_interval=0.05)
    queue = durable.app.conf.task_default_queue
    consumer = _Consumer()
    keeper = upkeep.Upkeep(
        durable.runtime,
        durable.engine,
        durable.app,
        SimpleNamespace(hostname="consuming@test", consumer=consumer),
    )
    with running_upkeep(keeper):
        until(lambda: find_node(durable, "consuming@test"), "the node registered")
        durable.pause_queue(queue)
        until(lambda: consumer.calls == [("cancel", queue)], "the paused queue's consumer cancelled")
        durable.resume_queue(queue)
        until(lambda: consumer.calls == [("cancel", queue), ("add", queue)], "the queue consumed again")


def test_the_relay_backs_off_while_the_broker_refuses_and_polls_again_once_it_takes_a_message(
    make_durable, monkeypatch, caplog
):
    outbox = RecordingOutbox()
    durable = make_durable(poll_interval=0.05, outbox=outbox)
    wf = two_step_workflow(durable)
    run_id = durable.start(wf, {"n": 1})
    assert durable.flush(timeout=10)
    set_run(durable, run_id, published=False)  # its message never left: the relay's to send
    outbox.clear()
    tries: list[str] = []

    def accept(sent: Any) -> bool:
        tries.append(sent.run_id)
        return len(tries) > 7  # the broker refuses seven times, then takes it

    outbox.accept = accept
    keeper = Paced(durable, fast=("durable-relay",))
    with caplog.at_level(logging.WARNING, logger="durable_celery"), running_upkeep(keeper):
        until(lambda: keeper.passes("durable-relay") >= 11, "eleven relay waits")
    # Doubling pauses from a second, at most RELAY_BACKOFF_MAX; the poll interval once it works.
    waits = keeper.waits["durable-relay"][:11]
    assert waits == [0.05, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0, 0.05, 0.05, 0.05]
    assert tries == [run_id] * 8 and run_row(durable, run_id).published is True
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("durable relay:")]
    assert len(warned) == 1, warned  # once for the outage, not once per pass


def test_the_relay_thread_tells_steps_whether_this_worker_sends_task_events(durable):
    flag = durable.engine.task_events

    def noted(worker: Any, before: int) -> int:
        flag.value = before
        upkeep.Upkeep(durable.runtime, durable.engine, durable.app, worker)._note_task_events()
        return int(flag.value)

    def with_dispatcher(**dispatcher: Any) -> Any:
        return SimpleNamespace(
            hostname="events@test", consumer=SimpleNamespace(event_dispatcher=SimpleNamespace(**dispatcher))
        )

    for before in (0, 1):  # no worker, no consumer or no dispatcher yet: what the options said stays
        assert noted(None, before) == before
        assert noted(SimpleNamespace(hostname="events@test"), before) == before
        assert noted(SimpleNamespace(hostname="events@test", consumer=SimpleNamespace()), before) == before
    assert noted(with_dispatcher(enabled=True), 0) == 1  # -E: every group
    assert noted(with_dispatcher(enabled=True, groups=None), 0) == 1
    assert noted(with_dispatcher(enabled=True, groups=["worker", "task"]), 0) == 1  # enable_events
    assert noted(with_dispatcher(enabled=True, groups=["worker"]), 1) == 0  # heartbeats only
    assert noted(with_dispatcher(enabled=False, groups=["task"]), 1) == 0
    assert noted(with_dispatcher(enabled=False), 1) == 0
    assert noted(with_dispatcher(), 1) == 0  # a dispatcher that says nothing sends nothing


def test_housekeeping_prunes_a_backlog_pass_after_pass_and_then_waits_its_intervals(
    make_durable, monkeypatch
):
    monkeypatch.setattr(prune, "BATCH", 2)
    durable = make_durable(poll_interval=0.05, prune={"completed": "1h"})
    wf = two_step_workflow(durable)

    def old_completed(n: int) -> str:
        run_id = durable.start(wf, {"n": n})
        set_run(durable, run_id, status="completed", finished_at=ago(durable, 7200))
        return run_id

    def old_activity(what: str) -> None:
        with durable.db.begin() as conn:
            activity_rows.record_txn(durable.db, conn, what, None, None, None, {})
            conn.execute(update(activity).where(activity.c.kind == what).values(at=ago(durable, 8 * 86400)))

    backlog = [old_completed(n) for n in range(5)]  # three batches of two
    old_activity("old_note")
    keeper = Paced(durable)
    with running_upkeep(keeper):
        until(lambda: not any(_exists(durable, r) for r in backlog), "the backlog pruned")
        until(lambda: queues.list_samples(durable.db), "a queue sample")
        until(lambda: durable.activity(kinds=["old_note"]) == [], "week-old activity trimmed")
        # Each job now waits its interval (an hour, a minute, an hour): a few passes do nothing.
        later = old_completed(9)
        old_activity("later_note")
        with durable.db.begin() as conn:
            conn.execute(delete(queue_samples))
        passes = keeper.passes("durable-housekeeping")
        until(lambda: keeper.passes("durable-housekeeping") >= passes + 4, "four more housekeeping passes")
        assert _exists(durable, later)
        assert len(durable.activity(kinds=["later_note"])) == 1
        assert queues.list_samples(durable.db) == []


# -- how the threads run ------------------------------------------------------------------------


def test_a_guarded_job_is_logged_once_until_it_works_again_and_raises_only_what_it_is_told(durable, caplog):
    keeper = upkeep.Upkeep(durable.runtime, durable.engine, durable.app)
    failing = [True]

    def flaky() -> str:
        if failing[0]:
            raise RuntimeError("away")
        return "done"

    class Nameless:  # a job without a __name__ is named by its str()
        def __call__(self) -> None:
            raise RuntimeError("away")

        def __str__(self) -> str:
            return "nameless-job"

    def refused() -> None:
        raise BrokerDown("refused")

    with caplog.at_level(logging.DEBUG, logger="durable_celery"):
        assert keeper._guarded(flaky) is None
        assert keeper._guarded(flaky) is None
        failing[0] = False
        assert keeper._guarded(flaky) == "done"
        assert keeper._guarded(flaky) == "done"
        failing[0] = True
        assert keeper._guarded(flaky) is None  # failing again: logged again
        assert keeper._guarded(Nameless()) is None
        with pytest.raises(BrokerDown):
            keeper._guarded(refused, raising=(BrokerDown,))
        assert keeper._guarded(refused) is None
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "durable_celery"]
    assert said == [
        ("ERROR", "durable upkeep: flaky failed (logged once until it works again)"),
        ("DEBUG", "durable upkeep: flaky still failing"),
        ("WARNING", "durable upkeep: flaky works again"),
        ("ERROR", "durable upkeep: flaky failed (logged once until it works again)"),
        ("ERROR", "durable upkeep: nameless-job failed (logged once until it works again)"),
        ("ERROR", "durable upkeep: refused failed (logged once until it works again)"),
    ]


def test_each_wait_is_jittered_a_quarter_either_way_and_a_stop_ends_it(durable):
    class Noted(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            self.timeouts: list[float | None] = []

        def wait(self, timeout: float | None = None) -> bool:
            self.timeouts.append(timeout)
            return super().wait(timeout)

    keeper = upkeep.Upkeep(durable.runtime, durable.engine, durable.app)
    keeper._stop = stop = Noted()
    assert keeper._wait(0.01) is False  # waited its time
    stop.set()
    assert all(keeper._wait(2.0) is True for _ in range(2000))  # stopped: at once
    first, *spread = stop.timeouts
    assert first is not None and 0.0075 <= first <= 0.0125
    assert 1.5 <= min(spread) < 1.55 and 2.45 < max(spread) <= 2.5  # type: ignore[type-var]


def test_start_runs_three_named_daemon_threads_once_and_stop_ends_them(durable):
    keeper = upkeep.Upkeep(durable.runtime, durable.engine, durable.app)
    before = upkeep_threads()
    for _ in range(2):  # and again after a stop
        keeper.start()
        try:
            started = upkeep_threads() - before
            assert {t.name for t in started} == THREADS and all(t.daemon for t in started)
            keeper.start()  # running already: nothing more
            assert upkeep_threads() - before == started
        finally:
            keeper.stop()
        assert not any(t.is_alive() for t in started)


def test_stop_waits_for_a_stuck_pass_only_so_long(durable, monkeypatch):
    monkeypatch.setattr(upkeep, "STOP_WAIT", 0.2)
    inside, release = threading.Event(), threading.Event()

    class Stuck(upkeep.Upkeep):
        def _register_node(self) -> None:  # the relay's first query hangs
            inside.set()
            release.wait(10)

    keeper = Stuck(durable.runtime, durable.engine, durable.app)
    keeper.start()
    try:
        assert inside.wait(10)
        began = time.monotonic()
        keeper.stop()
        assert time.monotonic() - began < 5  # not the 10 s the pass hangs
        (relay,) = [t for t in keeper._threads if t.name == "durable-relay"]
        assert relay.is_alive()
    finally:
        release.set()
    relay.join(10)
    assert not relay.is_alive()  # it ends once its pass does
