"""Every key decision's records, exactly: the activity entry, the signals, the messages sent and
the rows written, on both backends and on testing.Fake.

Holders are put in the status a case needs by writing it directly; the decision reads nothing
else. Messages are recorded instead of sent, so a wrong step index or attempt in one shows.
Written against mutants of durable_celery/core/keys.py and store/key_rows.py that the behaviour
tests let through.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import delete, select

from durable_celery import KeyContended, KeyTaken, SendEvent, signals
from durable_celery.core import rollout
from durable_celery.schedules import fires as schedule_fires
from durable_celery.store import key_rows
from durable_celery.store.child_rows import CHILDREN_WAIT
from durable_celery.store.schema import events, keys, runs
from durable_celery.testing import Fake, wait_for, worker
from tests.integration.helpers import (
    key_holders,
    key_row,
    only_entry,
    run_row,
    set_run,
    started_run,
    two_step_workflow,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["postgres", "sqlite", "fake"])
def backend(request: pytest.FixtureRequest) -> str:
    """Each decision's records also hold on testing.Fake, so it cannot drift from them."""
    return str(request.param)


def _duplicate_details(wf: Any, outcome: str, policy: str, status: str, data: Any, **more: Any) -> dict:
    return {
        "key": "k",
        "workflow": wf.name,
        "outcome": outcome,
        "policy": policy,
        "input_changed": True,
        "input": data,
        "holder_status": status,
        **more,
    }


@pytest.mark.parametrize("status", ["pending", "running", "waiting"])
def test_use_existing_answers_from_an_unfinished_holder(durable, seen, status):
    wf = two_step_workflow(durable)
    holder = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, holder, status=status)
    assert durable.start(wf, {"n": 2}, key="k") == holder
    entry = only_entry(durable, "key_duplicate")
    assert (entry.run_id, entry.workflow) == (holder, wf.name)
    assert entry.details == _duplicate_details(wf, "use_existing", "use_existing", status, {"n": 2})
    assert seen.signals == [
        ("key_duplicate", {"run_id": holder, "workflow": wf.name, "key": "k", "outcome": "use_existing"})
    ]
    assert seen.published == []
    assert len(durable.list_runs()) == 1


def test_the_same_input_again_is_recorded_as_unchanged(durable, seen):
    wf = two_step_workflow(durable)
    holder = started_run(durable, wf, seen, {"n": 1})
    assert durable.start(wf, {"n": 1}, key="k") == holder
    assert only_entry(durable, "key_duplicate").details["input_changed"] is False


@pytest.mark.parametrize(
    "options",
    [{}, {"on_duplicate": "error"}, {"debounce": {"period": 60}}],
    ids=["use_existing", "error", "debounce"],
)
@pytest.mark.parametrize(
    ("first", "again", "changed"),
    [
        ({"n": 1}, {"n": True}, True),
        ({"n": True}, {"n": 1}, True),
        ({"n": 0}, {"n": False}, True),
        ({"n": 1}, {"n": 1.0}, False),
        ({"n": [1, {"a": 2}]}, {"n": [1.0, {"a": 2.0}]}, False),
        ({"n": "1"}, {"n": 1}, True),
    ],
)
def test_input_changed_follows_json_equality_on_every_path(durable, seen, options, first, again, changed):
    """One rule on every backend and policy (PostgreSQL's one-statement answer compares jsonb):
    ``true`` is not ``1``, ``1`` is ``1.0``; the dropped-input counts follow it."""
    wf = two_step_workflow(durable, **options)
    holder = durable.start(wf, first, key="k")
    try:
        assert durable.start(wf, again, key="k") == holder
    except KeyTaken as refused:
        assert refused.holder_id == holder
    entry = only_entry(durable, "key_duplicate")
    assert entry.details["input_changed"] is changed
    dropped = changed and entry.details["outcome"] in ("use_existing", "error")
    assert durable.stats.keys()["dropped_inputs"] == int(dropped)


def test_error_refuses_with_the_holder_and_records_it(durable, seen):
    wf = two_step_workflow(durable, on_duplicate="error")
    holder = started_run(durable, wf, seen, {"n": 1})
    with pytest.raises(KeyTaken) as refused:
        durable.start(wf, {"n": 2}, key="k")
    assert refused.value.holder_id == holder
    entry = only_entry(durable, "key_duplicate")
    assert entry.run_id == holder
    assert entry.details == _duplicate_details(wf, "error", "error", "pending", {"n": 2})
    assert seen.signals == [
        ("key_duplicate", {"run_id": holder, "workflow": wf.name, "key": "k", "outcome": "error"})
    ]
    assert seen.published == []


def test_a_finished_holder_that_reuse_frees_hands_the_key_to_a_new_run(durable, seen):
    wf = two_step_workflow(durable, on_duplicate="error")  # after_close: a completed holder frees the key
    holder = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, holder, status="completed")
    new = durable.start(wf, {"n": 2}, key="k")
    assert new != holder
    assert key_holders(durable, wf.name) == (new, None)
    entry = only_entry(durable, "key_handed_off")
    assert (entry.run_id, entry.details) == (
        new,
        {"key": "k", "workflow": wf.name, "from": holder, "from_status": "completed"},
    )
    assert durable.activity(kinds=["key_duplicate"]) == []
    assert seen.signals == [
        ("run_started", {"run_id": new, "workflow": wf.name, "key": "k"}),
        ("key_handoff", {"run_id": new, "workflow": wf.name, "key": "k", "previous_id": holder}),
    ]
    assert seen.published == [(wf.name, 0, new, 1, "k")]
    assert durable.get_run(holder).status == "completed"


@pytest.mark.parametrize("policy", ["use_existing", "error"])
def test_a_finished_holder_kept_by_reuse_answers_or_refuses(durable, seen, policy):
    wf = two_step_workflow(durable, reuse="after_failure")
    holder = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, holder, status="completed")
    if policy == "use_existing":
        assert durable.start(wf, {"n": 2}, key="k") == holder
    else:
        with pytest.raises(KeyTaken):
            durable.start(wf, {"n": 2}, key="k", on_duplicate=policy)
    outcome = "use_existing" if policy == "use_existing" else "error"
    entry = only_entry(durable, "key_duplicate")
    assert entry.details == _duplicate_details(wf, outcome, policy, "completed", {"n": 2})
    assert seen.signals == [
        ("key_duplicate", {"run_id": holder, "workflow": wf.name, "key": "k", "outcome": outcome})
    ]
    assert seen.published == []


def test_cancel_existing_replaces_the_holder_and_its_waiting_run(durable, seen):
    wf = two_step_workflow(durable)
    holder = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, holder, status="running", started_at=durable.db.utcnow())  # claimed
    waiting = durable.start(wf, {"n": 2}, key="k", on_duplicate="run_again")
    seen.clear()
    new = durable.start(wf, {"n": 3}, key="k", on_duplicate="cancel_existing")
    reason = {"type": "Cancelled", "message": f"replaced by run {new}", "replaced_by": new, "traceback": None}
    for run_id in (holder, waiting):
        run = durable.get_run(run_id)
        assert (run.status, run.error) == ("cancelled", reason)
        assert run.finished_at is not None
    assert key_holders(durable, wf.name) == (new, None)
    entry = [
        e for e in durable.activity(kinds=["key_duplicate"]) if e.details["outcome"] == "cancel_existing"
    ]
    assert len(entry) == 1 and entry[0].run_id == holder
    assert entry[0].details == _duplicate_details(
        wf, "cancel_existing", "cancel_existing", "running", {"n": 3}, replaced_by=new
    )
    handed = only_entry(durable, "key_handed_off")
    assert (handed.run_id, handed.details["from"], handed.details["from_status"]) == (new, holder, "running")
    assert seen.signals == [
        ("run_started", {"run_id": new, "workflow": wf.name, "key": "k"}),
        ("run_finished", {"run_id": waiting, "workflow": wf.name, "status": "cancelled"}),
        ("key_duplicate", {"run_id": holder, "workflow": wf.name, "key": "k", "outcome": "cancel_existing"}),
        ("run_finished", {"run_id": holder, "workflow": wf.name, "status": "cancelled"}),
        ("key_handoff", {"run_id": new, "workflow": wf.name, "key": "k", "previous_id": holder}),
    ]
    assert seen.published == [(wf.name, 0, new, 1, "k")]


def test_run_again_behind_a_claimed_holder_waits_without_the_key(durable, seen):
    wf = two_step_workflow(durable, on_duplicate="run_again", timeout=600)
    holder = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, holder, status="running", started_at=durable.db.utcnow())
    waiting = durable.start(wf, {"n": 2}, key="k")
    row = run_row(durable, waiting)
    assert (row.status, row.due_at, row.published, row.runs_after_id) == ("waiting", None, False, holder)
    assert (row.deadline_at, row.input, row.key) == (None, {"n": 2}, "k")
    assert key_holders(durable, wf.name) == (holder, waiting)
    entry = only_entry(durable, "key_duplicate")
    assert entry.run_id == holder
    assert entry.details == _duplicate_details(
        wf, "run_again", "run_again", "running", {"n": 2}, runs_after=waiting
    )
    dup = ("key_duplicate", {"run_id": holder, "workflow": wf.name, "key": "k", "outcome": "run_again"})
    assert seen.signals == [("run_started", {"run_id": waiting, "workflow": wf.name, "key": "k"}), dup]
    assert seen.published == []
    seen.clear()

    assert durable.start(wf, {"n": 3}, key="k") == waiting  # the newest input replaces it
    assert run_row(durable, waiting).input == {"n": 3}
    assert run_row(durable, holder).input == {"n": 1}
    latest = durable.activity(kinds=["key_duplicate"])[0]
    assert latest.details["runs_after"] == waiting and latest.details["outcome"] == "run_again"
    assert seen.signals == [dup] and seen.published == []
    assert len(durable.list_runs()) == 2


def test_run_again_gives_an_unclaimed_holder_the_newer_input(durable, seen):
    wf = two_step_workflow(durable, on_duplicate="run_again")
    bystander = durable.start(wf, {"n": 0}, key="other")  # unclaimed too: left alone
    holder = durable.start(wf, {"n": 1}, key="k")
    seen.clear()
    due = run_row(durable, holder).due_at
    assert durable.start(wf, {"n": 2}, key="k") == holder
    row = run_row(durable, holder)
    assert (row.input, row.due_at, row.status) == ({"n": 2}, due, "pending")
    assert key_row(durable, wf.name, "k").waiting_id is None
    assert run_row(durable, bystander).input == {"n": 0}
    entry = only_entry(durable, "key_duplicate")
    assert entry.details == _duplicate_details(wf, "run_again", "run_again", "pending", {"n": 2})
    assert seen.signals == [
        ("key_duplicate", {"run_id": holder, "workflow": wf.name, "key": "k", "outcome": "run_again"})
    ]
    assert len(durable.list_runs()) == 2


def _events(durable: Any, run_id: str) -> list[tuple[str, Any]]:
    with durable.db.engine.connect() as conn:
        rows = conn.execute(select(events.c.name, events.c.payload).where(events.c.run_id == run_id)).all()
    return [(r.name, r.payload) for r in rows]


@pytest.mark.parametrize("waits", [False, True])
def test_send_event_delivers_the_input_to_the_holder(durable, seen, waits):
    wf = two_step_workflow(durable, on_duplicate=SendEvent("update"))
    holder = started_run(durable, wf, seen, {"n": 1})
    if waits:
        set_run(durable, holder, status="waiting", wait_name="update", due_at=None, published=False)
    assert durable.start(wf, {"n": 2}, key="k") == holder
    assert _events(durable, holder) == [("update", {"n": 2})]
    entry = only_entry(durable, "key_duplicate")
    status = "waiting" if waits else "pending"
    assert entry.details == _duplicate_details(
        wf, "send_event", "send_event:update", status, {"n": 2}, event="update"
    )
    assert seen.signals == [
        ("key_duplicate", {"run_id": holder, "workflow": wf.name, "key": "k", "outcome": "send_event"})
    ]
    if waits:  # woken: due now and sent
        row = run_row(durable, holder)
        assert row.due_at is not None and row.published is True
        assert seen.published == [(wf.name, 0, holder, 1, "k")]
    else:
        assert seen.published == []


def test_debounce_folds_a_start_into_the_unclaimed_holder_capped_by_its_timeout(durable, seen):
    wf = two_step_workflow(durable, debounce={"period": 30, "timeout": 45})
    bystander = durable.start(wf, {"n": 0}, key="other")  # debounced and unclaimed too: left alone
    holder = durable.start(wf, {"n": 1}, key="k")
    other = run_row(durable, bystander)
    first = run_row(durable, holder)
    assert first.published is False and first.not_after is not None
    assert seen.published == []
    seen.clear()
    set_run(durable, holder, published=True)  # as if the relay looked at it: a fold sets it back
    if isinstance(durable, Fake):
        durable.advance(1)  # a Fake's clock stands still until it is moved
    assert durable.start(wf, {"n": 2}, key="k") == holder
    row = run_row(durable, holder)
    assert row.input == {"n": 2} and row.published is False
    assert row.due_at > first.due_at  # the wait restarts ...
    assert row.due_at < first.not_after  # ... a period from now, before the cap (45 s from the first)
    entry = only_entry(durable, "key_duplicate")
    assert entry.details == _duplicate_details(wf, "debounced", "use_existing", "pending", {"n": 2})
    assert seen.signals == [
        ("key_duplicate", {"run_id": holder, "workflow": wf.name, "key": "k", "outcome": "debounced"})
    ]
    after = run_row(durable, bystander)
    assert (after.input, after.due_at, after.published) == (other.input, other.due_at, other.published)
    # Past the cap the due time is the cap itself.
    set_run(durable, holder, not_after=first.due_at)
    durable.start(wf, {"n": 3}, key="k")
    assert run_row(durable, holder).due_at == run_row(durable, holder).not_after


def test_a_waiting_run_takes_the_key_when_its_holder_is_cancelled(durable, seen):
    wf = two_step_workflow(durable, on_duplicate="run_again")
    holder = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, holder, status="running", started_at=durable.db.utcnow())
    waiting = durable.start(wf, {"n": 2}, key="k")
    other_holder = durable.start(wf, {"n": 1}, key="other")  # another key's waiting run: left alone
    set_run(durable, other_holder, status="running", started_at=durable.db.utcnow())
    other_waiting = durable.start(wf, {"n": 2}, key="other")
    seen.clear()
    assert durable.cancel(holder) is True
    row = run_row(durable, waiting)
    assert (row.status, row.published) == ("pending", True) and row.due_at is not None
    assert key_holders(durable, wf.name) == (waiting, None)
    other = run_row(durable, other_waiting)
    assert (other.status, other.due_at, other.published) == ("waiting", None, False)
    assert key_holders(durable, wf.name, "other") == (other_holder, other_waiting)
    entry = only_entry(durable, "key_handed_off")
    assert (entry.run_id, entry.details) == (
        waiting,
        {"key": "k", "workflow": wf.name, "from": holder, "from_status": "cancelled"},
    )
    assert seen.signals == [
        ("run_finished", {"run_id": holder, "workflow": wf.name, "status": "cancelled"}),
        ("key_handoff", {"run_id": waiting, "workflow": wf.name, "key": "k", "previous_id": holder}),
    ]
    assert seen.published == [(wf.name, 0, waiting, 1, "k")]


def test_a_waiting_run_is_cancelled_when_reuse_keeps_the_key(durable):
    wf = durable.workflow("kept", reuse="after_failure", on_duplicate="run_again")
    entered, release = threading.Event(), threading.Event()

    @wf.step
    def only(n=0):
        entered.set()
        assert release.wait(15)
        return n

    finished: list[dict[str, Any]] = []

    def on_finished(sender: Any, **kw: Any) -> None:
        if sender is durable:
            finished.append({k: v for k, v in kw.items() if k != "signal"})

    signals.run_finished.connect(on_finished, weak=False)
    try:
        with worker(durable):
            holder = durable.start(wf, {"n": 1}, key="k")
            assert entered.wait(15)
            waiting = durable.start(wf, {"n": 2}, key="k")
            release.set()
            assert wait_for(durable, holder).status == "completed"
            run = wait_for(durable, waiting)
    finally:
        signals.run_finished.disconnect(on_finished)
    message = f"run {holder} completed and reuse='after_failure' keeps the key"
    assert (run.status, run.error) == (
        "cancelled",
        {"type": "Cancelled", "traceback": None, "message": message},
    )
    assert (key_row(durable, "kept", "k").holder_id, key_row(durable, "kept", "k").waiting_id) == (
        holder,
        None,
    )
    assert {"run_id": waiting, "workflow": "kept", "status": "cancelled"} in finished
    assert durable.list_steps(waiting) == []


def test_cancel_existing_on_a_child_wakes_its_waiting_parent(durable, seen):
    wf = two_step_workflow(durable)
    parent_wf = two_step_workflow(durable, "parent")
    parent = durable.start(parent_wf)
    set_run(
        durable, parent, status="waiting", wait_name=CHILDREN_WAIT, due_at=None, published=False, step_index=1
    )
    child = durable.start(wf, {"n": 1}, key="k")
    set_run(durable, child, parent_id=parent)
    seen.clear()
    new = durable.start(wf, {"n": 2}, key="k", on_duplicate="cancel_existing")
    assert durable.get_run(child).status == "cancelled"
    row = run_row(durable, parent)
    assert row.due_at is not None and row.published is True
    assert seen.published == [(wf.name, 0, new, 1, "k"), ("parent", 1, parent, 1, None)]


@pytest.mark.parametrize("keyed", [True, False])
def test_a_cancelled_child_wakes_its_waiting_parent(durable, seen, keyed):
    wf = two_step_workflow(durable)
    parent_wf = two_step_workflow(durable, "parent")
    parent = durable.start(parent_wf)
    waits = {"status": "waiting", "wait_name": CHILDREN_WAIT, "due_at": None, "published": False}
    set_run(durable, parent, step_index=1, **waits)
    child = durable.start(wf, {"n": 1}, key="k" if keyed else None)
    set_run(durable, child, parent_id=parent)
    seen.clear()
    assert durable.cancel(child) is True
    row = run_row(durable, parent)
    assert row.due_at is not None and row.published is True
    assert seen.published == [("parent", 1, parent, 1, None)]
    assert ("run_finished", {"run_id": child, "workflow": wf.name, "status": "cancelled"}) in seen.signals


def test_a_cancelled_waiting_run_no_longer_waits_behind_the_holder(durable, seen):
    wf = two_step_workflow(durable, on_duplicate="run_again")
    other = two_step_workflow(durable, "other_wf", on_duplicate="run_again")
    holder = started_run(durable, wf, seen, {"n": 1})
    other_holder = durable.start(other, {"n": 1}, key="k")
    for run_id in (holder, other_holder):
        set_run(durable, run_id, status="running", started_at=durable.db.utcnow())
    waiting = durable.start(wf, {"n": 2}, key="k")
    other_waiting = durable.start(other, {"n": 2}, key="k")
    assert durable.cancel(waiting) is True
    assert key_holders(durable, wf.name) == (holder, None)
    assert key_holders(durable, "other_wf") == (other_holder, other_waiting)  # untouched
    assert durable.get_run(waiting).status == "cancelled"
    assert durable.start(wf, {"n": 3}, key="k") not in (holder, waiting)  # a new one waits


def test_use_existing_on_postgresql_answers_an_unfinished_holder_without_a_lock(durable, seen, monkeypatch):
    # architecture.md: one statement finds the unfinished holder and records the duplicate;
    # only SQLite (and a finished holder) takes the key row's lock.
    wf = two_step_workflow(durable)
    holder = started_run(durable, wf, seen, {"n": 1})
    locks = []
    real = key_rows.lock_key_txn
    monkeypatch.setattr(key_rows, "lock_key_txn", lambda *a: locks.append(a) or real(*a))
    assert durable.start(wf, {"n": 2}, key="k") == holder
    assert len(locks) == (0 if durable.db.is_postgres else 1)
    entry = only_entry(durable, "key_duplicate")
    assert entry.details == _duplicate_details(wf, "use_existing", "use_existing", "pending", {"n": 2})


def test_use_existing_on_a_freed_key_takes_it_instead_of_answering(durable, seen):
    wf = two_step_workflow(durable)  # after_close
    holder = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, holder, status="completed")
    new = durable.start(wf, {"n": 2}, key="k")  # use_existing
    assert new != holder
    assert key_holders(durable, wf.name) == (new, None)
    assert durable.activity(kinds=["key_duplicate"]) == []


def test_use_existing_answers_from_the_holder_of_its_own_workflow(durable, seen):
    a, b = two_step_workflow(durable, "wf_a"), two_step_workflow(durable, "wf_b")
    holder_a, holder_b = durable.start(a, {"n": 1}, key="k"), durable.start(b, {"n": 1}, key="k")
    assert durable.start(b, {"n": 2}, key="k") == holder_b
    assert durable.start(a, {"n": 2}, key="k") == holder_a
    assert [(e.run_id, e.workflow) for e in durable.activity(kinds=["key_duplicate"])] == [
        (holder_a, "wf_a"),
        (holder_b, "wf_b"),
    ]


def test_debounce_folds_a_start_made_in_the_callers_transaction_too(durable, seen):
    wf = two_step_workflow(durable, debounce={"period": 30})
    holder = durable.start(wf, {"n": 1}, key="k")
    with durable.db.engine.connect() as conn, conn.begin():
        assert durable.start(wf, {"n": 2}, key="k", connection=conn) == holder
    assert run_row(durable, holder).input == {"n": 2}
    assert only_entry(durable, "key_duplicate").details["outcome"] == "debounced"


def test_cancel_existing_cancels_the_replaced_holders_unfinished_children_at_once(durable, seen):
    wf = two_step_workflow(durable)
    kid_wf = two_step_workflow(durable, "kid")
    holder = started_run(durable, wf, seen, {"n": 1})
    kids = [durable.start(kid_wf, {"n": n}) for n in (1, 2)]
    done = durable.start(kid_wf, {"n": 3})
    for kid in kids:
        set_run(durable, kid, parent_id=holder)
    set_run(durable, done, parent_id=holder, status="completed")
    other = durable.start(kid_wf, {"n": 4})  # another run's child: left alone
    set_run(durable, other, parent_id=durable.start(kid_wf, {"n": 5}))
    seen.clear()
    new = durable.start(wf, {"n": 2}, key="k", on_duplicate="cancel_existing")
    assert durable.get_run(holder).status == "cancelled"
    assert [durable.get_run(kid).status for kid in kids] == ["cancelled", "cancelled"]
    assert (durable.get_run(done).status, durable.get_run(other).status) == ("completed", "pending")
    finished = [kw["run_id"] for name, kw in seen.signals if name == "run_finished"]
    assert sorted(finished) == sorted([holder, *kids])
    assert durable.list_children(new) == []


def test_a_keyed_starts_message_leaves_from_the_publisher_thread(durable, request):
    if isinstance(durable, Fake):
        pytest.skip("a Fake sends no messages: its steps run in the calling thread")
    from celery.signals import before_task_publish

    wf = two_step_workflow(durable)
    threads: list[str] = []

    def note(sender: Any = None, **_: Any) -> None:
        if sender == f"durable.{wf.name}.first":
            threads.append(threading.current_thread().name)

    before_task_publish.connect(note, weak=False)
    try:
        holder = durable.start(wf, {"n": 1}, key="k")
        durable.cancel(holder)
        durable.start(wf, {"n": 2}, key="k")  # the freed key handed to a new run
        durable.start(wf, {"n": 3})  # no key
        assert durable.flush(timeout=10)
    finally:
        before_task_publish.disconnect(note)
        if durable.db.is_postgres:
            request.getfixturevalue("redis_client").delete(durable.app.conf.task_default_queue)
    assert threads == ["durable-publisher"] * 3


def test_a_step_message_for_a_run_another_worker_holds_ends_nothing(durable, seen):
    # A worker without the step fails the run with definition_changed only if no worker holds
    # it; a held run is left alone, its key kept and no end announced.
    wf = two_step_workflow(durable)
    holder = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, holder, status="running", started_at=durable.db.utcnow(), locked_by="other@node")
    message = {"run_id": holder, "step": 0}
    assert rollout.handle_unknown_step(durable.runtime, f"durable.{wf.name}.gone", message) is None
    assert run_row(durable, holder).status == "running"
    assert key_holders(durable, wf.name) == (holder, None)
    assert seen.signals == [] and seen.published == []
    set_run(durable, holder, locked_by=None)  # no worker holds it now: it fails
    assert (
        rollout.handle_unknown_step(durable.runtime, f"durable.{wf.name}.gone", message)
        == "definition_changed"
    )
    assert run_row(durable, holder).status == "failed"
    assert seen.signals == [("run_finished", {"run_id": holder, "workflow": wf.name, "status": "failed"})]


def test_a_schedule_fire_tells_a_new_run_from_a_duplicate(durable, seen):
    wf = two_step_workflow(durable)
    keyed = schedule_fires.start_fire(durable.runtime, wf.name, "k", {"n": 1}, None)
    unkeyed = schedule_fires.start_fire(durable.runtime, wf.name, None, {"n": 1}, None)
    assert (keyed["outcome"], unkeyed["outcome"]) == ("started", "started")
    again = schedule_fires.start_fire(durable.runtime, wf.name, "k", {"n": 2}, None)
    assert again == {"outcome": "duplicate", "run_id": keyed["run_id"]}
    elsewhere = schedule_fires.start_fire(durable.runtime, "not_here", "k", {"n": 1}, None)  # no code here
    assert elsewhere["outcome"] == "started" and durable.get_run(elsewhere["run_id"]).status == "pending"
    assert seen.published == [(wf.name, 0, keyed["run_id"], 1, "k"), (wf.name, 0, unkeyed["run_id"], 1, None)]
    started = [kw for name, kw in seen.signals if name == "run_started"]
    assert started == [
        {"run_id": keyed["run_id"], "workflow": wf.name, "key": "k"},
        {"run_id": unkeyed["run_id"], "workflow": wf.name, "key": None},
        {"run_id": elsewhere["run_id"], "workflow": "not_here", "key": "k"},
    ]


def test_a_holder_cancelled_where_its_workflow_is_not_defined_hands_the_key_on(durable, seen, make_durable):
    # A process without the workflow's code (a CLI, another service) cancels the holder: the
    # run waiting behind it takes the key by the default reuse rule.
    wf = two_step_workflow(durable, on_duplicate="run_again")
    holder = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, holder, status="running", started_at=durable.db.utcnow())
    waiting = durable.start(wf, {"n": 2}, key="k")
    bare = make_durable("bare")
    assert wf.name not in bare.workflows
    assert bare.cancel(holder) is True
    row = run_row(durable, waiting)
    assert (row.status, row.published) == ("pending", True)
    assert key_holders(durable, wf.name) == (waiting, None)
    assert durable.get_run(holder).status == "cancelled"


def test_a_key_released_while_a_start_decides_is_taken_by_that_start(durable, seen, monkeypatch):
    # The start found the key held (on PostgreSQL by its one-statement try), then the key row
    # went for good (a release_key committed) before its lock: the next hand claims the key.
    wf = two_step_workflow(durable, reuse="never", on_duplicate="error")
    holder = started_run(durable, wf, seen, {"n": 1})
    set_run(durable, holder, status="completed")
    real, locks = key_rows.lock_key_txn, []

    def lock_key_txn(db: Any, conn: Any, workflow: str, key: str) -> Any:
        if not locks:  # the release commits just before the first lock
            if durable.db.is_postgres:
                with durable.db.engine.begin() as other:
                    other.execute(delete(keys).where(keys.c.workflow == workflow, keys.c.key == key))
            else:  # SQLite: the start holds the write lock, so the release runs on its connection
                conn.execute(delete(keys).where(keys.c.workflow == workflow, keys.c.key == key))
        locks.append(key)
        return real(db, conn, workflow, key)

    monkeypatch.setattr(key_rows, "lock_key_txn", lock_key_txn)
    new = durable.start(wf, {"n": 2}, key="k")
    assert new != holder
    assert key_holders(durable, wf.name) == (new, None)
    assert len(locks) == 1
    assert seen.published == [(wf.name, 0, new, 1, "k")]


def _delete_run_leaving_its_key_row(durable: Any, run_id: str) -> None:
    """Delete a run as a session with triggers (PostgreSQL) or foreign keys (SQLite) off would
    (a restore, a replica's apply): its key row is left naming a run that does not exist."""
    if durable.db.is_postgres:
        with durable.db.engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
            conn.execute(delete(runs).where(runs.c.id == run_id))
        return
    with durable.db.engine.connect() as conn:
        raw = conn.connection.driver_connection
        raw.execute("PRAGMA foreign_keys=OFF")
        raw.execute("DELETE FROM durable_runs WHERE id = ?", (run_id,))
        raw.commit()
        raw.execute("PRAGMA foreign_keys=ON")


def test_a_key_row_naming_a_run_that_is_gone_is_dropped_and_the_key_taken(durable, seen):
    wf = two_step_workflow(durable, reuse="never", on_duplicate="error")
    gone = started_run(durable, wf, seen, {"n": 1})
    _delete_run_leaving_its_key_row(durable, gone)
    assert key_holders(durable, wf.name) == (gone, None)
    new = durable.start(wf, {"n": 2}, key="k")
    assert new != gone
    assert key_holders(durable, wf.name) == (new, None)
    assert seen.published == [(wf.name, 0, new, 1, "k")]


def test_a_start_that_keeps_finding_the_key_gone_is_refused_naming_the_key(durable, seen, monkeypatch):
    # Every lock finds the key row gone (another transaction has it each time) while every
    # claim finds it held: after three hands the start gives up, saying which key.
    wf = two_step_workflow(durable, on_duplicate="error")
    holder = started_run(durable, wf, seen, {"n": 1})
    monkeypatch.setattr(key_rows, "lock_key_txn", lambda *args: None)
    with pytest.raises(KeyContended) as contended:
        durable.start(wf, {"n": 2}, key="k")
    assert str(contended.value) == f"key 'k' of {wf.name!r} changed hands 3 times"
    assert [r.id for r in durable.list_runs()] == [holder]


def test_key_statistics_count_every_readd_and_break_down_the_newest(durable, seen, monkeypatch):
    """Counts and hours cover every re-add (up to the cap); the breakdown by outcome and key
    covers the newest ``READDS_BROKEN_DOWN``, which ``breakdown_of`` says; with reuse="never"
    every kept key of a finished run blocks a start."""
    from durable_celery.observe import activity as observed

    monkeypatch.setattr(observed, "READDS_BROKEN_DOWN", 2)
    wf = two_step_workflow(durable, reuse="never")
    holder = started_run(durable, wf, seen, {"n": 1}, key="a")
    for n in range(3):
        assert durable.start(wf, {"n": n}, key="a") == holder
    seen.clear()
    done = started_run(durable, wf, seen, {"n": 1}, key="b")
    set_run(durable, done, status="completed")
    stats = durable.stats.keys(workflow=wf.name)
    assert (stats["keys_held"], stats["blocking"]) == (2, 2)
    assert stats["readds"] == 3 and sum(h["count"] for h in stats["readds_over_time"]) == 3
    assert stats["breakdown_of"] == 2
    assert stats["readds_by_outcome"] == {"use_existing": 2}
    assert stats["top_keys"] == [{"workflow": wf.name, "key": "a", "readds": 2}]
    assert stats["dropped_inputs"] == 1  # of the newest two, {"n": 2} changed the input ({"n": 1} did not)
