"""A start without a key sends its first step's message while its row commits (PostgreSQL, the
background publisher): a worker that has the message before the run is there waits for the
start's commit and runs the step; if the start never commits, the message is dropped.

A worker's message handling runs in a thread of the test (``engine.execute``, as a worker runs a
message); the race is made certain, not hoped for: the start's hand-over waits until that
thread is seen in PostgreSQL's lock table waiting on the start."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from sqlalchemy import func, select, text

from durable_celery.errors import DatabaseUnavailable
from durable_celery.store.queries import START_LOCK
from durable_celery.testing import RecordingOutbox

pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("backend", ["postgres"])]

WAIT = 15.0  # seconds any one wait may take, on a loaded machine


def waiting_on_a_start(durable: Any) -> bool:
    """Is a session of this test's database waiting for a start's lock?"""
    query = text(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = :lock"
        " AND NOT granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    with durable.db.engine.connect() as conn:
        return bool(conn.execute(query, {"lock": START_LOCK}).scalar())


def until(condition: Any) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Handler:
    """Handles one step message in a thread, as a worker would, and keeps what it came to."""

    def __init__(self, durable: Any, workflow: Any, run_id: str) -> None:
        self.results: list[str] = []
        step = workflow.steps[0]
        work = lambda: self.results.append(durable.engine.execute(workflow, step, run_id, False))  # noqa: E731
        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()

    def outcome(self) -> list[str]:
        self.thread.join(WAIT)
        return self.results


def test_the_first_message_goes_before_the_commit_and_its_worker_waits_for_it(durable, monkeypatch):
    ran: list[str] = []
    wf = durable.workflow("ahead")
    wf.step(lambda **_: ran.append(threading.current_thread().name), name="only")
    handlers: list[Handler] = []
    seen_row: list[bool] = []

    def send_named(workflow: str, run_id: str, step_index: int, attempt: int, key: Any, soon: bool = False):
        # Called while the start's INSERT has not committed: the run is not there for others.
        with durable.db.engine.connect() as conn:
            seen_row.append(
                bool(conn.execute(select(func.count()).select_from(text("durable_runs"))).scalar())
            )
        assert (workflow, step_index, attempt, key, soon) == ("ahead", 0, 1, None, True)
        handlers.append(Handler(durable, wf, run_id))  # the worker that got the message
        until(lambda: waiting_on_a_start(durable))
        return True

    monkeypatch.setattr(durable.outbox, "send_named", send_named)
    run_id = durable.start(wf, {"n": 1})

    assert seen_row == [False]
    assert [h.outcome() for h in handlers] == [["completed"]]
    assert len(ran) == 1
    assert durable.get_run(run_id).status == "completed"


def test_a_message_whose_start_never_commits_is_dropped(durable):
    ran: list[int] = []
    wf = durable.workflow("ahead_lost")
    wf.step(lambda **_: ran.append(1), name="only")
    run_id = str(uuid.uuid4())
    lock = text("SELECT pg_advisory_xact_lock(:lock, hashtext(:id))")
    with durable.db.engine.connect() as conn:  # a start that took its lock, then failed
        conn.execute(lock, {"lock": START_LOCK, "id": run_id})
        handler = Handler(durable, wf, run_id)
        until(lambda: waiting_on_a_start(durable))
        conn.rollback()
    assert handler.outcome() == ["dropped"]
    assert ran == []


def test_a_keyed_start_sends_after_its_commit(durable, monkeypatch):
    wf = durable.workflow("after_commit")
    wf.step(lambda **_: None, name="only")
    committed: list[bool] = []

    def send_named(workflow: str, run_id: str, *_: Any, **__: Any) -> bool:
        with durable.db.engine.connect() as conn:
            found = conn.execute(text("SELECT count(*) FROM durable_runs WHERE id = :id"), {"id": run_id})
            committed.append(bool(found.scalar()))
        return True

    monkeypatch.setattr(durable.outbox, "send_named", send_named)
    durable.start(wf, {"n": 1}, key="k1")  # its key may answer with another run: no message ahead
    assert committed == [True]


def test_a_message_refused_before_its_start_committed_still_leaves_the_run_to_the_relay(durable, monkeypatch):
    wf = durable.workflow("ahead_refused")
    wf.step(lambda **_: None, name="only")
    flagging: list[threading.Thread] = []

    def send_named(workflow: str, run_id: str, *_: Any, **__: Any) -> bool:
        # The broker refused the message at once: the publisher flags the run for the relay.
        flagging.append(threading.Thread(target=durable.outbox.flag_unsent, args=([run_id],), daemon=True))
        flagging[0].start()
        until(lambda: waiting_on_a_start(durable))
        return True

    monkeypatch.setattr(durable.outbox, "send_named", send_named)
    run_id = durable.start(wf, {"n": 1})
    flagging[0].join(WAIT)
    assert not flagging[0].is_alive()
    with durable.db.engine.connect() as conn:
        published = conn.execute(text("SELECT published FROM durable_runs WHERE id = :id"), {"id": run_id})
        assert published.scalar() is False  # the relay sends it at its next pass


def test_a_start_that_loses_its_connection_raises_database_unavailable_and_nothing_else(durable, caplog):
    wf = durable.workflow("ahead_cut_off")
    wf.step(lambda **_: None, name="only")
    durable.start(wf, {"n": 0})  # the pool holds connections used a moment ago (not pinged again)
    cut = text(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    url = durable.db.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as admin:  # not one of the pool's
        assert admin.execute(str(cut)).fetchone()[0] >= 1
    caplog.set_level(logging.WARNING, logger="psycopg")
    with pytest.raises(DatabaseUnavailable):
        durable.start(wf, {"n": 1})
    assert [r.getMessage() for r in caplog.records if r.name.startswith("psycopg")] == []


class OutboxOfBefore(RecordingOutbox):
    """An outbox written before ``sends_ahead`` existed."""

    @property
    def sends_ahead(self) -> bool:
        raise AttributeError("sends_ahead")


def test_an_outbox_without_sends_ahead_gets_its_messages_after_the_commit(make_durable):
    outbox = OutboxOfBefore()
    durable = make_durable(outbox=outbox)
    wf = durable.workflow("older_outbox")
    wf.step(lambda **_: None, name="only")
    run_id = durable.start(wf, {"n": 1})
    assert outbox.run_ids() == [run_id]
