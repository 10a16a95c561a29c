"""The upkeep sweeps' results, exactly: what each pass returns, announces and hands on, and how
much one pass takes (mutants of durable_celery/upkeep.py that the behaviour tests let through),
on both backends. Each sweep is called once, directly; rows are put in the state a case needs
by writing them directly.

Then the threads that run them (``Upkeep``) and the worker bootstep that starts and stops those
(``install``), driven in this process with short intervals: what each thread does and how often,
seen in the database, waiting on conditions with deadlines. ``Paced`` notes each wait of each
thread, which is how a test counts a thread's passes (and reads its backoff without waiting it
out). Messages are recorded instead of sent."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import delete, event, select, update

from durable_celery import prune, queues, upkeep
from durable_celery.relay import BrokerDown
from durable_celery.store import activity_rows, event_rows
from durable_celery.store.schema import activity, nodes, queue_samples, runs
from durable_celery.testing import worker

from .test_mutation_keys import _define, _key_holders, _row, _set, _started

pytestmark = pytest.mark.timeout(60)


def _ago(durable: Any, seconds: float) -> Any:
    return durable.db.utcnow() - timedelta(seconds=seconds)


def _waiting(durable: Any, run_id: str, name: str = "paid") -> None:
    _set(durable, run_id, status="waiting", wait_name=name, due_at=None, published=False)
    _set(durable, run_id, started_at=_ago(durable, 5))


def test_the_timeout_sweep_announces_the_end_and_hands_the_key_to_the_run_waiting_behind(durable, seen):
    wf = _define(durable, reuse="after_failure", timeout=600)  # a failed holder frees the key
    holder = _started(durable, wf, seen, {"n": 1})
    _set(durable, holder, status="running", started_at=_ago(durable, 9), locked_by="w:1:1")
    _set(durable, holder, heartbeat_at=_ago(durable, 1), deadline_at=_ago(durable, 1))
    behind = durable.start(wf, {"n": 2}, key="k", on_duplicate="run_again")
    assert _key_holders(durable, wf.name) == (holder, behind)
    seen.clear()
    assert upkeep.fail_overdue_once(durable) == [holder]
    assert ("run_finished", {"run_id": holder, "workflow": wf.name, "status": "failed"}) in seen.signals
    assert _key_holders(durable, wf.name) == (behind, None)
    assert _row(durable, behind).status == "pending"
    assert seen.published == [(wf.name, 0, behind, 1, "k")]


def test_the_wake_up_sweep_counts_the_runs_it_woke(durable, seen):
    wf = _define(durable)
    first, second, not_kept = (durable.start(wf, {"n": n}) for n in range(3))
    for run_id in (first, second, not_kept):
        _waiting(durable, run_id)
    with durable.db.begin() as conn:  # kept for them, but their wake-up was never sent
        event_rows.insert_event_txn(durable.db, conn, first, "paid", {"n": 1})
        event_rows.insert_event_txn(durable.db, conn, second, "paid", {"n": 2})
    assert upkeep.wake_missed_once(durable) == 2
    assert [_row(durable, r).due_at is not None for r in (first, second, not_kept)] == [True, True, False]
    assert upkeep.wake_missed_once(durable) == 0


def test_each_sweep_takes_one_batch_a_pass(durable, seen, monkeypatch):
    monkeypatch.setattr(upkeep, "RELAY_BATCH", 2)
    wf = _define(durable)
    stale = [durable.start(wf, {"n": n}) for n in range(3)]
    for run_id in stale:
        _set(durable, run_id, status="running", locked_by="gone:1:1", heartbeat_at=_ago(durable, 3600))
    handed_back, failed = upkeep.sweep_stale_once(durable)
    assert (len(handed_back), failed) == (2, [])
    assert upkeep.sweep_stale_once(durable)[0] == [r for r in stale if r not in handed_back]

    missed = [durable.start(wf, {"n": n}) for n in range(3)]
    for run_id in missed:
        _waiting(durable, run_id)
        with durable.db.begin() as conn:
            event_rows.insert_event_txn(durable.db, conn, run_id, "paid", None)
    assert upkeep.wake_missed_once(durable) == 2
    assert upkeep.wake_missed_once(durable) == 1

    parent = durable.start(wf, {"n": 9})
    _set(durable, parent, status="cancelled", finished_at=durable.db.utcnow())
    children = [durable.start(wf, {"n": n}) for n in range(3)]
    for child in children:
        _set(durable, child, parent_id=parent)
    assert len(upkeep.cancel_orphans_once(durable)) == 2
    assert len(upkeep.cancel_orphans_once(durable)) == 1
    assert {_row(durable, c).status for c in children} == {"cancelled"}


def test_stale_locks_are_swept_only_once_the_database_was_seen_for_the_whole_timeout(durable):
    keeper = upkeep.Upkeep(durable)
    timeout = durable.settings.stale_lock_timeout
    keeper.db_seen_since = None  # away now
    assert keeper.may_sweep_stale() is False
    keeper.db_seen_since = time.monotonic()  # just came back
    assert keeper.may_sweep_stale() is False
    keeper.db_seen_since = time.monotonic() - timeout - 1
    assert keeper.may_sweep_stale() is True


@pytest.mark.parametrize("status", ["running", "compensating"])
def test_the_stale_sweep_records_and_announces_a_run_lost_for_good(make_durable, status):
    durable = make_durable(max_losses=2)
    wf = _define(durable)
    run_id = durable.start(wf, {"n": 1}, key="k")
    also = durable.start(wf, {"n": 2})  # lost for good too: the pass goes on to it
    lock = {"locked_by": "gone:1:1", "heartbeat_at": _ago(durable, 3600), "losses": 1}
    _set(durable, run_id, status=status, started_at=_ago(durable, 3600), **lock)
    _set(durable, also, status="running", started_at=_ago(durable, 3600), **lock)
    finished: list[dict[str, Any]] = []
    recovered: list[dict[str, Any]] = []

    def receive(into: list[dict[str, Any]]) -> Any:
        def store(sender: Any, **kwargs: Any) -> None:
            if sender is durable:
                kwargs.pop("signal", None)
                into.append(kwargs)

        return store

    from durable_celery import signals

    on_finished, on_recovered = receive(finished), receive(recovered)
    signals.run_finished.connect(on_finished, weak=False)
    signals.stale_recovered.connect(on_recovered, weak=False)
    try:
        handed_back, failed = upkeep.sweep_stale_once(durable)
    finally:
        signals.run_finished.disconnect(on_finished)
        signals.stale_recovered.disconnect(on_recovered)
    assert (handed_back, sorted(failed)) == ([], sorted([run_id, also]))
    assert recovered == [{"run_ids": [], "failed_ids": failed}]
    ended = "compensation_failed" if status == "compensating" else "failed"
    assert {"run_id": run_id, "workflow": wf.name, "status": ended} in finished
    assert {"run_id": also, "workflow": wf.name, "status": "failed"} in finished and len(finished) == 2
    assert _row(durable, run_id).status == ended
    (entry,) = [e for e in durable.activity(kinds=["stale_recovered"]) if e.run_id == run_id]
    assert entry.workflow == wf.name
    details = {"key": "k", "workflow": wf.name, "locked_by": "gone:1:1", "losses": 2, "failed": True}
    assert entry.details == details


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite: the sweep's transaction writes alone
def test_a_stale_run_that_beats_again_before_the_take_back_is_left_alone(durable):
    from sqlalchemy import event, update

    from durable_celery.store.schema import runs

    wf = _define(durable)
    run_id = durable.start(wf, {"n": 1})
    _set(durable, run_id, status="running", locked_by="slow:1:1", heartbeat_at=_ago(durable, 3600))
    beaten: list[bool] = []

    def beat_first(conn, cursor, statement, parameters, context, executemany):
        # The sweep read the run as stale; its worker beats just before the take-back.
        if beaten or not statement.startswith("UPDATE durable_runs"):
            return
        beaten.append(True)
        with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as other:
            other.execute(update(runs).where(runs.c.id == run_id).values(heartbeat_at=durable.db.utcnow()))

    event.listen(durable.db.engine, "before_cursor_execute", beat_first)
    try:
        assert upkeep.sweep_stale_once(durable) == ([], [])
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", beat_first)
    assert beaten and _row(durable, run_id).locked_by == "slow:1:1"
    assert durable.activity(kinds=["stale_recovered"]) == []


def test_a_stopping_worker_shows_its_node_as_draining(durable):
    from types import SimpleNamespace

    keeper = upkeep.Upkeep(durable, SimpleNamespace(hostname="leaving@test"))
    other = upkeep.Upkeep(durable, SimpleNamespace(hostname="staying@test"))
    keeper._register_node(durable)
    other._register_node(durable)
    keeper.mark_draining(durable)
    draining = {n["name"]: n["draining"] for n in durable.list_nodes()}
    assert draining == {"leaving@test": True, "staying@test": False}
    upkeep.Upkeep(durable).mark_draining(durable)  # no worker, no node: nothing to mark


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_forking_pool_is_refused_only_on_a_one_process_store(make_durable, capsys, pool):
    import uuid

    from celery import Celery
    from celery.concurrency import get_implementation
    from celery.exceptions import WorkerShutdown

    from durable_celery import Durable

    worker = type("Worker", (), {"pool": get_implementation(pool)(limit=1)})()
    memory = Durable(Celery("one_process", broker="memory://"), f"memory://{uuid.uuid4().hex}")
    try:
        if pool == "prefork":
            with pytest.raises(WorkerShutdown) as refused:
                upkeep.refuse_forking_pool(memory, worker)
            assert refused.value.args == (1,)  # the worker's exit code
            said = capsys.readouterr()
            assert said.out == ""
            assert said.err == (
                f"durable: the {memory.db.masked_url} store is one process only (missing MULTI_PROCESS): "
                "start this worker with --pool threads (or solo), or give Durable a database URL\n"
            )
        else:
            upkeep.refuse_forking_pool(memory, worker)
        upkeep.refuse_forking_pool(make_durable(), worker)  # a shared store: any pool will do
        upkeep.refuse_forking_pool(memory, type("Starting", (), {})())  # no pool yet
    finally:
        memory.db.dispose()


# -- the threads: Upkeep, driven in this process ---------------------------------------------

THREADS = {"durable-relay", "durable-sweeper", "durable-housekeeping"}


def _until(check: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.02)


class Paced(upkeep.Upkeep):
    """An Upkeep that notes every wait of every thread (one per pass) and cuts the waits of the
    threads in ``fast`` to a hundredth of a second (the noted value stays what it meant)."""

    def __init__(self, durable: Any, worker: Any = None, fast: tuple[str, ...] = ()) -> None:
        super().__init__(durable, worker)
        self.waits: dict[str, list[float]] = defaultdict(list)
        self.fast = fast

    def _wait(self, seconds: float) -> bool:
        name = threading.current_thread().name
        self.waits[name].append(seconds)
        return super()._wait(0.01 if name in self.fast else seconds)

    def passes(self, thread: str) -> int:
        return len(self.waits[thread])


@contextmanager
def _running(keeper: upkeep.Upkeep) -> Iterator[upkeep.Upkeep]:
    keeper.start()
    try:
        yield keeper
    finally:
        keeper.stop()


def _record_sends(durable: Any, monkeypatch: Any) -> list[str]:
    """The run ids of the messages sent from now on (recorded, not sent)."""
    sent: list[str] = []

    def publish(workflow: Any, step_index: int, run_id: str, attempt: int, key: Any, **kw: Any) -> bool:
        sent.append(run_id)
        return True

    def publish_named(workflow: str, run_id: str, step_index: int, attempt: int, key: Any, **kw: Any) -> bool:
        sent.append(run_id)
        return True

    monkeypatch.setattr(durable, "publish", publish)
    monkeypatch.setattr(durable, "publish_named", publish_named)
    return sent


def _exists(durable: Any, run_id: str) -> bool:
    with durable.db.engine.connect() as conn:
        return conn.execute(select(runs.c.id).where(runs.c.id == run_id)).first() is not None


def _node(durable: Any, name: str) -> dict[str, Any] | None:
    return next((n for n in durable.list_nodes() if n["name"] == name), None)


def _upkeep_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name in THREADS}


def _missed_wakeup(durable: Any, run_id: str) -> None:
    _waiting(durable, run_id)
    with durable.db.begin() as conn:  # kept for it, but its wake-up was never sent
        event_rows.insert_event_txn(durable.db, conn, run_id, "paid", None)


def test_the_sweeper_fails_overdue_runs_every_pass_and_sweeps_once_a_sweep_interval(
    make_durable, monkeypatch
):
    # The first sweep comes after min(sweep_interval, stale_lock_timeout), the next a whole
    # sweep_interval (a minute) later; an overdue run fails at the next pass.
    durable = make_durable(poll_interval=0.05, stale_lock_timeout=0.6, sweep_interval=60.0)
    sent = _record_sends(durable, monkeypatch)
    wf = _define(durable)
    overdue, stale, missed, parent, child = (durable.start(wf, {"n": n}) for n in range(5))
    _set(durable, overdue, deadline_at=_ago(durable, 1))
    lock = {"locked_by": "gone:1:1", "heartbeat_at": _ago(durable, 3600), "started_at": _ago(durable, 3600)}
    _set(durable, stale, status="running", **lock)
    _missed_wakeup(durable, missed)
    _set(durable, parent, status="cancelled", finished_at=durable.db.utcnow())
    _set(durable, child, parent_id=parent)
    keeper = Paced(durable)
    began = time.monotonic()
    with _running(keeper):
        _until(lambda: _row(durable, overdue).status == "failed", "overdue run failed")
        _until(lambda: _row(durable, missed).due_at is not None, "missed wake-up done")
        assert time.monotonic() - began >= 0.6  # the first sweep: not before min(60, 0.6) s
        # The same sweep handed the stale run back (a node that has seen the database since it
        # started may sweep at once) and cancelled the cancelled parent's child.
        assert _row(durable, stale).locked_by is None
        assert _row(durable, child).status == "cancelled"
        _until(lambda: {stale, missed} <= set(sent), "the relay sending the runs due again")

        late_overdue, late_missed = (durable.start(wf, {"n": n}) for n in (5, 6))
        _set(durable, late_overdue, deadline_at=_ago(durable, 1))
        _missed_wakeup(durable, late_missed)
        passes = keeper.passes("durable-sweeper")
        _until(lambda: _row(durable, late_overdue).status == "failed", "late overdue run failed")
        _until(lambda: keeper.passes("durable-sweeper") >= passes + 5, "five more sweeper passes")
        assert _row(durable, late_missed).due_at is None  # the next sweep is a minute away
    assert durable.list_nodes() == []  # an Upkeep outside a worker is no node


def test_a_nodes_row_is_written_afresh_at_start_and_beaten_about_once_a_second(make_durable):
    durable = make_durable(poll_interval=0.05)  # heartbeat_interval 0.3 s: a node beats at most once a second
    host = SimpleNamespace(hostname="beating@test")
    last_life = upkeep.Upkeep(durable, host)
    last_life._register_node(durable)
    last_life.mark_draining(durable)
    with durable.db.begin() as conn:
        hour_ago = _ago(durable, 3600)
        conn.execute(
            update(nodes).where(nodes.c.name == "beating@test").values(started_at=hour_ago, seen_at=hour_ago)
        )
    old = _node(durable, "beating@test")
    assert old is not None and old["draining"] is True
    keeper = upkeep.Upkeep(durable, host)
    seen: list[Any] = []  # the row's seen_at since the start, as it changed

    def beaten_a_second_after_the_start() -> bool:
        node = _node(durable, "beating@test")
        assert node is not None
        if node["draining"] or node["started_at"] == old["started_at"]:  # not registered afresh yet
            return False
        if not seen or seen[-1] != node["seen_at"]:
            seen.append(node["seen_at"])
        return (node["seen_at"] - node["started_at"]).total_seconds() >= 0.9

    with _running(keeper):
        _until(beaten_a_second_after_the_start, "a beat a second after the start")
    node = _node(durable, "beating@test")
    assert node is not None and node["draining"] is False and node["pid"] == os.getpid()
    assert node["queues"] == [durable.app.conf.task_default_queue]
    started = node["started_at"]
    # Registered afresh at the start, beaten at the sweeper's first pass, then a second later.
    assert len([at for at in seen if (at - started).total_seconds() < 0.9]) <= 2, seen
    assert (seen[-1] - started).total_seconds() < 1.6, seen


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
    keeper = upkeep.Upkeep(durable, SimpleNamespace(hostname="consuming@test", consumer=consumer))
    with _running(keeper):
        _until(lambda: _node(durable, "consuming@test"), "the node registered")
        durable.pause_queue(queue)
        _until(lambda: consumer.calls == [("cancel", queue)], "the paused queue's consumer cancelled")
        durable.resume_queue(queue)
        _until(lambda: consumer.calls == [("cancel", queue), ("add", queue)], "the queue consumed again")


def test_the_relay_backs_off_while_the_broker_refuses_and_polls_again_once_it_takes_a_message(
    make_durable, monkeypatch, caplog
):
    durable = make_durable(poll_interval=0.05)
    wf = _define(durable)
    _record_sends(durable, monkeypatch)
    run_id = durable.start(wf, {"n": 1})
    assert durable.flush(timeout=10)
    _set(durable, run_id, published=False)  # its message never left: the relay's to send
    tries: list[str] = []

    def publish(workflow: Any, step_index: int, run_id: str, attempt: int, key: Any, **kw: Any) -> bool:
        tries.append(run_id)
        return len(tries) > 7  # the broker refuses seven times, then takes it

    monkeypatch.setattr(durable, "publish", publish)
    keeper = Paced(durable, fast=("durable-relay",))
    with caplog.at_level(logging.WARNING, logger="durable_celery"), _running(keeper):
        _until(lambda: keeper.passes("durable-relay") >= 11, "eleven relay waits")
    # Doubling pauses from a second, at most RELAY_BACKOFF_MAX; the poll interval once it works.
    waits = keeper.waits["durable-relay"][:11]
    assert waits == [0.05, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0, 0.05, 0.05, 0.05]
    assert tries == [run_id] * 8 and _row(durable, run_id).published is True
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("durable relay:")]
    assert len(warned) == 1, warned  # once for the outage, not once per pass


def test_housekeeping_prunes_a_backlog_pass_after_pass_and_then_waits_its_intervals(
    make_durable, monkeypatch
):
    monkeypatch.setattr(prune, "BATCH", 2)
    durable = make_durable(poll_interval=0.05, prune={"completed": "1h"})
    wf = _define(durable)

    def old_completed(n: int) -> str:
        run_id = durable.start(wf, {"n": n})
        _set(durable, run_id, status="completed", finished_at=_ago(durable, 7200))
        return run_id

    def old_activity(what: str) -> None:
        with durable.db.begin() as conn:
            activity_rows.record_txn(durable.db, conn, what, None, None, None, {})
            conn.execute(update(activity).where(activity.c.kind == what).values(at=_ago(durable, 8 * 86400)))

    backlog = [old_completed(n) for n in range(5)]  # three batches of two
    old_activity("old_note")
    keeper = Paced(durable)
    with _running(keeper):
        _until(lambda: not any(_exists(durable, r) for r in backlog), "the backlog pruned")
        _until(lambda: queues.list_samples(durable), "a queue sample")
        _until(lambda: durable.activity(kinds=["old_note"]) == [], "week-old activity trimmed")
        # Each job now waits its interval (an hour, a minute, an hour): a few passes do nothing.
        later = old_completed(9)
        old_activity("later_note")
        with durable.db.begin() as conn:
            conn.execute(delete(queue_samples))
        passes = keeper.passes("durable-housekeeping")
        _until(lambda: keeper.passes("durable-housekeeping") >= passes + 4, "four more housekeeping passes")
        assert _exists(durable, later)
        assert len(durable.activity(kinds=["later_note"])) == 1
        assert queues.list_samples(durable) == []


@pytest.mark.parametrize("backend", ["postgres"])  # RedBeat entries live in Redis
def test_the_sweep_restores_a_vanished_redbeat_entry(pg_url, redis_client, backend):
    from celery import Celery

    from durable_celery import Durable
    from tests.conftest import FAST, REDIS_URL

    from .test_schedule_restore import define, missing, vanish

    app = Celery("restore_upkeep", broker=REDIS_URL)
    app.conf.task_default_queue = f"q-{uuid.uuid4().hex[:8]}"
    app.conf.redbeat_redis_url = REDIS_URL
    app.conf.redbeat_key_prefix = f"test-upkeep-{uuid.uuid4().hex[:8]}:"
    durable = Durable(app, pg_url, **{**FAST, "poll_interval": 0.05, "sweep_interval": 0.3})
    try:
        durable.schedule(define(durable), "* * * * *", key="k", name="minutely")
        vanish(durable, redis_client, "minutely")
        assert len(missing(durable)) == 1
        with _running(upkeep.Upkeep(durable)):
            _until(lambda: missing(durable) == [], "the entry restored")
    finally:
        durable.db.dispose()


def test_a_failing_job_is_logged_once_and_tried_again_and_stale_locks_wait_out_the_timeout_after(
    make_durable, caplog
):
    # The sweeper's statements fail for a while (its database is away); then they work again.
    durable = make_durable(poll_interval=0.05, stale_lock_timeout=1.0, sweep_interval=0.2)
    wf = _define(durable)
    overdue, stale = (durable.start(wf, {"n": n}) for n in range(2))
    _set(durable, overdue, deadline_at=_ago(durable, 1))
    _set(durable, stale, status="running", locked_by="gone:1:1", heartbeat_at=_ago(durable, 3600))
    away = threading.Event()
    away.set()

    def refuse(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if away.is_set() and threading.current_thread().name == "durable-sweeper":
            raise ConnectionError("the database is away")

    keeper = Paced(durable)
    event.listen(durable.db.engine, "before_cursor_execute", refuse)
    try:
        with caplog.at_level(logging.DEBUG, logger="durable_celery"), _running(keeper):
            _until(lambda: keeper.passes("durable-sweeper") >= 8, "eight sweeper passes")  # sweeps too
            assert _row(durable, overdue).status == "pending" and keeper.db_seen_since is None
            away.clear()
            back = time.monotonic()
            _until(lambda: _row(durable, overdue).status == "failed", "the overdue run failed")
            _until(lambda: _row(durable, stale).locked_by is None, "the stale run handed back")
            assert time.monotonic() - back >= 1.0  # the whole stale_lock_timeout after it came back
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", refuse)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "fail_overdue_once" in r.getMessage()]
    assert said[0] == ("ERROR", "durable upkeep: fail_overdue_once failed (logged once until it works again)")
    assert {level for level, _ in said[1:-1]} == {"DEBUG"} and len(said) >= 4
    assert said[-1] == ("WARNING", "durable upkeep: fail_overdue_once works again")


def test_a_guarded_job_is_logged_once_until_it_works_again_and_raises_only_what_it_is_told(durable, caplog):
    keeper = upkeep.Upkeep(durable)
    failing = [True]

    def flaky(given: Any) -> str:
        assert given is durable
        if failing[0]:
            raise RuntimeError("away")
        return "done"

    class Nameless:  # a job without a __name__ is named by its str()
        def __call__(self, given: Any) -> None:
            raise RuntimeError("away")

        def __str__(self) -> str:
            return "nameless-job"

    def refused(given: Any) -> None:
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


def test_the_relay_thread_tells_steps_whether_this_worker_sends_task_events(durable):
    flag = durable.engine.task_events

    def noted(worker: Any, before: int) -> int:
        flag.value = before
        upkeep.Upkeep(durable, worker)._note_task_events()
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


def test_each_wait_is_jittered_a_quarter_either_way_and_a_stop_ends_it(durable):
    class Noted(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            self.timeouts: list[float | None] = []

        def wait(self, timeout: float | None = None) -> bool:
            self.timeouts.append(timeout)
            return super().wait(timeout)

    keeper = upkeep.Upkeep(durable)
    keeper._stop = stop = Noted()
    assert keeper._wait(0.01) is False  # waited its time
    stop.set()
    assert all(keeper._wait(2.0) is True for _ in range(2000))  # stopped: at once
    first, *spread = stop.timeouts
    assert first is not None and 0.0075 <= first <= 0.0125
    assert 1.5 <= min(spread) < 1.55 and 2.45 < max(spread) <= 2.5  # type: ignore[type-var]


def test_the_database_counts_as_seen_from_the_first_pass_that_reaches_it(durable):
    keeper = upkeep.Upkeep(durable)
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


def test_start_runs_three_named_daemon_threads_once_and_stop_ends_them(durable):
    keeper = upkeep.Upkeep(durable)
    before = _upkeep_threads()
    for _ in range(2):  # and again after a stop
        keeper.start()
        try:
            started = _upkeep_threads() - before
            assert {t.name for t in started} == THREADS and all(t.daemon for t in started)
            keeper.start()  # running already: nothing more
            assert _upkeep_threads() - before == started
        finally:
            keeper.stop()
        assert not any(t.is_alive() for t in started)


def test_stop_waits_for_a_stuck_pass_only_so_long(durable, monkeypatch):
    monkeypatch.setattr(upkeep, "STOP_WAIT", 0.2)
    inside, release = threading.Event(), threading.Event()

    class Stuck(upkeep.Upkeep):
        def _register_node(self, durable: Any) -> None:  # the relay's first query hangs
            inside.set()
            release.wait(10)

    keeper = Stuck(durable)
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


# -- the worker bootstep: install ---------------------------------------------------------------


def _bootstep(durable: Any) -> Any:
    (step,) = [s for s in durable.app.steps["worker"] if getattr(s, "__name__", None) == "DurableUpkeep"]
    return step


def _a_worker(durable: Any, name: str, pool: str = "threads", **more: Any) -> Any:
    from celery.concurrency import get_implementation

    return SimpleNamespace(
        hostname=name, app=durable.app, pool=get_implementation(pool)(limit=1), steps=[], **more
    )


def test_the_worker_bootstep_notes_the_worker_and_its_task_events_and_makes_its_upkeep(make_durable):
    durable = make_durable()
    step_class = _bootstep(durable)
    cases = [(True, False, 1), (False, True, 1), (None, True, 1), (None, False, 0), (False, False, 0)]
    for task_events, configured, on in cases:
        durable.app.conf.worker_send_task_events = configured
        durable.engine.task_events.value = 1 - on
        durable.engine.worker_pid = 0
        host = _a_worker(durable, "made@test", task_events=task_events)
        made = step_class(host).create(host)
        assert durable.engine.task_events.value == on, (task_events, configured)
        assert durable.engine.worker_pid == os.getpid()  # before the pool forks
        assert isinstance(made, upkeep.Upkeep) and made.durable is durable and made.worker is host
        assert made.node is not None and made.node.name == "made@test"
    durable.app.conf.worker_send_task_events = True
    no_option = SimpleNamespace(hostname="made@test", app=durable.app)  # a worker without the attribute
    step_class(no_option).create(no_option)
    assert durable.engine.task_events.value == 1
    off = make_durable(upkeep=False)
    host = _a_worker(off, "off@test")
    assert _bootstep(off)(host).create(host) is None


def test_the_worker_bootstep_starts_upkeep_afresh_and_marks_the_node_draining_as_it_stops(make_durable):
    durable = make_durable(poll_interval=0.05)
    step_class = _bootstep(durable)
    before = _upkeep_threads()
    for how in ("stop", "terminate"):  # a warm shutdown, a cold one
        name = f"{how}@test"
        host = _a_worker(durable, name, task_events=False)
        step = step_class(host)
        assert step.include(host) and host.steps == [step]
        durable.engine.drain(60)  # a worker that shut down before in this process
        step.start(host)
        try:
            assert not durable.engine.shutting_down()
            _until(lambda: _node(durable, name), "the node registered")  # noqa: B023 (called here)
            assert {t.name for t in _upkeep_threads() - before} == THREADS
        finally:
            getattr(step, how)(host)
        assert not _upkeep_threads() - before
        node = _node(durable, name)
        assert node is not None and node["draining"] is True
        assert durable.engine.shutting_down() is (how == "stop")  # only a warm one has a grace period
        durable.engine.undrain()


def test_the_worker_bootstep_refuses_a_forking_pool_on_a_one_process_store():
    from celery import Celery
    from celery.exceptions import WorkerShutdown

    from durable_celery import Durable

    memory = Durable(Celery("one_process", broker="memory://"), f"memory://{uuid.uuid4().hex}", upkeep=False)
    try:
        host = _a_worker(memory, "forking@test", pool="prefork")
        step = _bootstep(memory)(host)
        step.include(host)
        with pytest.raises(WorkerShutdown):
            step.start(host)
    finally:
        memory.db.dispose()


def test_a_worker_runs_upkeep_from_its_start_until_it_stops(make_durable):
    durable = make_durable(poll_interval=0.05)
    durable.engine.worker_pid = 0
    name = f"upkeep-{uuid.uuid4().hex[:6]}@test"
    before = _upkeep_threads()
    with worker(durable, hostname=name):
        _until(lambda: _node(durable, name), "the worker's node registered")
        assert {t.name for t in _upkeep_threads() - before} == THREADS
        assert durable.engine.worker_pid == os.getpid()
    assert not _upkeep_threads() - before
    node = _node(durable, name)
    assert node is not None and node["draining"] is True


# -- the module's passes: what a test above left to chance ------------------------------------


def test_the_timeout_sweep_fails_an_overdue_run_of_a_workflow_this_code_lacks(durable):
    wf = _define(durable)
    run_id = durable.start(wf, {"n": 1})
    _set(durable, run_id, workflow="renamed_since", deadline_at=_ago(durable, 1))
    assert upkeep.fail_overdue_once(durable) == [run_id]
    failed = _row(durable, run_id)
    assert failed.status == "failed"
    assert failed.error["message"] == "the run did not finish within its timeout of Nones"


def test_the_activity_trim_deletes_only_what_is_over_a_week_old(durable):
    with durable.db.begin() as conn:
        for what in ("recent", "old"):
            activity_rows.record_txn(durable.db, conn, what, None, None, None, {})
        conn.execute(update(activity).where(activity.c.kind == "old").values(at=_ago(durable, 8 * 86400)))
    assert upkeep.trim_activity_once(durable) == 1
    assert [e.kind for e in durable.activity(kinds=["recent", "old"])] == ["recent"]


def test_a_worker_without_a_database_url_it_can_use_exits_saying_why(capsys):
    from celery import Celery
    from celery.exceptions import WorkerShutdown

    from durable_celery import Durable

    durable = Durable(Celery("bad_url", broker="memory://"), "nonsense://x", upkeep=False)
    with pytest.raises(WorkerShutdown) as refused:
        upkeep.refuse_old_schema(durable)
    assert refused.value.args == (1,)  # the worker's exit code
    said = capsys.readouterr()
    assert (said.out, said.err) == ("", f"durable: {durable.db.bad_url}\n")


@pytest.mark.parametrize("backend", ["sqlite"])  # the schema check is the same on both
def test_a_worker_on_an_old_schema_exits_naming_every_pending_revision(tmp_path, capsys, backend):
    from alembic import command
    from celery import Celery
    from celery.exceptions import WorkerShutdown

    from durable_celery import Durable
    from durable_celery.app_argument import app_argument
    from durable_celery.store.migrate import alembic_config

    durable = Durable(Celery("behind", broker="memory://"), f"sqlite:///{tmp_path}/old.sqlite3", upkeep=False)
    try:
        command.upgrade(alembic_config(durable.db), "0003")
        pending = durable.pending_migrations()
        assert len(pending) >= 2
        with pytest.raises(WorkerShutdown) as refused:
            upkeep.refuse_old_schema(durable)
        assert refused.value.args == (1,)
        said = capsys.readouterr()
        assert said.out == ""
        assert said.err == (
            f"durable: the database schema is behind this code (pending revisions: {', '.join(pending)}); "
            f"run `celery -A {app_argument()} durable migrate`, then start this worker again\n"
        )
    finally:
        durable.db.dispose()
