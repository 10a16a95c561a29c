"""Helpers of the engine tests: a run taken over meanwhile, a run compensating its first step, a
write whose answer an outage lost, a run made due again.

These tests run steps through ``run_message``, as a worker runs a message, in the test's thread."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update

from durable_celery.store.schema import runs


def take_over_run(durable: Any, run_id: str, how: str) -> None:
    """Another worker took the run (its fence moved on), or it was cancelled meanwhile."""
    values = {"fence": runs.c.fence + 1} if how == "fenced" else {"status": "cancelled"}
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(**values))


def undo_flow(durable: Any, undo: Any) -> tuple[Any, str]:
    """A run compensating its first step with ``undo`` (the second step failed)."""
    wf = durable.workflow("undoing")
    wf.step(lambda: 1, name="first", compensate=undo)

    @wf.step
    def second():
        raise ValueError("declined")

    run_id = durable.start(wf)
    assert durable.run_message("undoing", 0, run_id) == "running"
    assert durable.run_message("undoing", 1, run_id) == "compensating"
    return wf, run_id


def answer_lost_once(monkeypatch: Any, durable: Any, commit: bool) -> list[int]:
    """The engine's next write fails with an outage once: after committing (its answer lost on
    the way back) or before."""
    from durable_celery import DatabaseUnavailable

    real = type(durable.engine)._write_once
    failed: list[int] = []

    def write_once(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(1)
            if commit:
                real(engine, *args, **kwargs)
            raise DatabaseUnavailable("postgresql://db", "connection lost")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(type(durable.engine), "_write_once", write_once)
    return failed


def set_losses(durable: Any, run_id: str) -> None:
    """One loss of the step in progress; a run backing off made due now."""
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(losses=1))
        conn.execute(
            update(runs)
            .where(runs.c.id == run_id, runs.c.due_at.is_not(None))
            .values(due_at=durable.db.utcnow())
        )
