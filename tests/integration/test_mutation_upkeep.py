"""The upkeep sweeps' results, exactly: what each pass returns, announces and hands on, and how
much one pass takes (mutants of durable_celery/upkeep.py that the behaviour tests let through),
on both backends. Each sweep is called once, directly; rows are put in the state a case needs
by writing them directly."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

from durable_celery import upkeep
from durable_celery.store import event_rows

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
