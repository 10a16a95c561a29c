"""A claim lost while its worker runs the step: after a failover to a standby that had not
received it, the run is as it was before the claim, due, and another worker takes it under the
same fence number. Every write of the first worker (its record, its heartbeat, its progress)
checks its ``locked_by`` as well as its fence, so none lands on the run the second now holds.

The failover is played on the run's row: the columns the claim set are put back as the standby
has them, then a second worker claims through the same statement a worker uses.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import select

from durable_celery import current_run
from durable_celery.errors import RunStopped
from durable_celery.store import queries
from durable_celery.store.schema import steps
from tests.integration.helpers import run_row, set_run

pytestmark = pytest.mark.timeout(60)
BEFORE_CLAIM = ("status", "fence", "locked_by", "heartbeat_at", "due_at", "published", "started_at")


@pytest.mark.parametrize("write", ["record", "heartbeat"])
def test_a_worker_whose_claim_was_lost_cannot_write_over_the_run_taken_again(durable, write):
    wf = durable.workflow("invoice")
    entered, release = threading.Event(), threading.Event()
    stopped: list[str] = []

    @wf.step
    def send(n: int) -> int:
        entered.set()
        release.wait(30)
        current_run().set_progress({"sent": n})  # refused: another holds the run now
        if write == "heartbeat":
            try:
                current_run().heartbeat()
            except RunStopped as exc:
                stopped.append(type(exc).__name__)
                raise
        return n

    run_id = durable.start(wf, {"n": 1})
    standby = {name: getattr(run_row(durable, run_id), name) for name in BEFORE_CLAIM}
    outcome: list[str] = []
    first = threading.Thread(target=lambda: outcome.append(durable.run_message("invoice", 0, run_id)))
    first.start()
    assert entered.wait(20)
    claimed = run_row(durable, run_id)
    assert (claimed.fence, claimed.status) == (standby["fence"] + 1, "running")

    set_run(durable, run_id, **standby)  # the failover: the claim is gone, the run due
    with durable.db.begin() as conn:  # another worker takes it, under the fence the first had
        taken: Any = queries.claim_run(durable.db, conn, run_id, 0, "other:1:1")
    assert (taken.fence, taken.locked_by) == (claimed.fence, "other:1:1")

    release.set()
    first.join(30)
    assert outcome == ["fenced"]
    assert stopped == (["StepFenced"] if write == "heartbeat" else [])
    row = run_row(durable, run_id)
    assert (row.status, row.fence, row.locked_by, row.output, row.progress) == (
        "running",
        claimed.fence,
        "other:1:1",
        None,
        None,
    )
    with durable.db.engine.connect() as conn:
        assert conn.execute(select(steps.c.id).where(steps.c.run_id == run_id)).all() == []
    assert [a.kind for a in durable.activity(kinds=["worker_fenced"], run_id=run_id)] == ["worker_fenced"]
