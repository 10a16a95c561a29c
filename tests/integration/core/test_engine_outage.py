"""A write of the engine the database did not answer (an outage): waited out in pauses never
longer than a heartbeat, with one warning; recorded once whether or not it had committed (a
step's or a compensation's); nothing recorded when the run was taken meanwhile.

Steps run through ``run_message``, as a worker runs a message, in the test's thread, on both
backends. Written against mutants of durable_celery/core/engine.py that the behaviour tests
let through."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update

from tests.integration.core.helpers import answer_lost_once, take_over_run, undo_flow
from tests.integration.helpers import run_row

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "not-committed"])
def test_a_write_an_outage_interrupted_is_recorded_once(durable, monkeypatch, commit):
    """Guards a past bug: a step's write retried after an outage whose commit had gone
    through unanswered matched the run again (same fence, still ``running``) and
    recorded the step a second time, which the unique index refused with an error."""
    wf = durable.workflow("outage")
    wf.step(lambda: 1, name="first")
    wf.step(lambda: 2, name="second")
    run_id = durable.start(wf)
    failed = answer_lost_once(monkeypatch, durable, commit)

    assert durable.run_message("outage", 0, run_id) == "running"

    assert failed == [1]
    steps = durable.list_steps(run_id)
    assert [(s.name, s.attempt, s.status, s.worker) for s in steps] == [
        ("first", 1, "completed", durable.engine.node)
    ]
    row = run_row(durable, run_id)
    assert (row.step_index, row.status, row.locked_by, row.published) == (1, "running", None, True)
    assert durable.run_message("outage", 1, run_id) == "completed"


def test_a_compensation_an_outage_interrupted_is_recorded_once(durable, monkeypatch):
    from durable_celery.store.schema import steps

    _, run_id = undo_flow(durable, lambda: "refunded")
    with durable.db.begin() as conn:  # the steps ran on another node: only the compensation's row is ours
        conn.execute(update(steps).where(steps.c.run_id == run_id).values(worker="elsewhere:1"))
    answer_lost_once(monkeypatch, durable, commit=True)
    assert durable.run_message("undoing", 0, run_id, compensate=True) == "compensated"
    undone = [s for s in durable.list_steps(run_id) if s.phase == "compensate"]
    assert [(s.name, s.attempt, s.output) for s in undone] == [("first", 1, "refunded")]


def test_a_write_an_outage_interrupted_meets_a_takeover_and_records_nothing(durable, monkeypatch):
    wf = durable.workflow("outage_taken")
    wf.step(lambda: 1, name="first")
    run_id = durable.start(wf)
    from durable_celery import DatabaseUnavailable

    real = type(durable.engine)._write_once
    failed: list[int] = []

    def write_once(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(1)
            take_over_run(durable, run_id, "fenced")  # while the database was away
            raise DatabaseUnavailable("postgresql://db", "connection lost")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(type(durable.engine), "_write_once", write_once)
    assert durable.run_message("outage_taken", 0, run_id) == "fenced"
    assert durable.list_steps(run_id) == []


def test_an_outage_is_waited_out_in_pauses_never_longer_than_a_heartbeat(make_durable, monkeypatch, caplog):
    from durable_celery import DatabaseUnavailable
    from durable_celery.core import engine as engine_module

    durable = make_durable(heartbeat_interval=1.0)
    wf = durable.workflow("patient")
    wf.step(lambda: 1, name="only")
    run_id = durable.start(wf)
    real = type(durable.engine)._write_once
    pauses: list[float] = []

    def write_once(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if len(pauses) < 4:
            raise DatabaseUnavailable("postgresql://db", "connection refused")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(type(durable.engine), "_write_once", write_once)
    monkeypatch.setattr(engine_module.time, "sleep", pauses.append)
    assert durable.run_message("patient", 0, run_id) == "completed"
    assert pauses == [0.2, 0.4, 0.8, 1.0]  # doubling, up to the heartbeat interval
    said = [r.getMessage() for r in caplog.records if "its outcome is kept until then" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"durable: run {run_id}: database unavailable at")  # once
