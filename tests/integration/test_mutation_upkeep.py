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
