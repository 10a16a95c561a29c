"""A claim finds its run by id, whatever PostgreSQL's statistics say about due runs.

After a long history of finished runs is analysed, the statistics say almost no run is due.
A burst of starts then makes many runs due before the next analyse. A claim written as plain
``due_at <= now()`` let the planner walk the small due index and filter every due run by id,
so each claim cost as much as the backlog. These tests read the plan of the claim a worker
runs (``run_message``: the statement a worker's step task runs).
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from sqlalchemy import event

from durable_celery import Durable

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]

HISTORY = """
INSERT INTO durable_runs (id, workflow, status, input, context, output, queue, step_index,
                          created_at, started_at, finished_at)
SELECT gen_random_uuid()::text, 'plan', 'completed', jsonb_build_object('n', i), '{}'::jsonb,
       '1'::jsonb, 'celery', 1, now() - make_interval(secs => i), now() - make_interval(secs => i),
       now() - make_interval(secs => i)
FROM generate_series(1, 50000) AS i
"""


def _claims_seen(durable: Durable) -> list[tuple[str, Any]]:
    seen: list[tuple[str, Any]] = []

    @event.listens_for(durable.db.engine, "before_cursor_execute")
    def keep(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.lstrip().startswith("UPDATE durable_runs") and "locked_by IS NULL" in statement:
            seen.append((statement, parameters))

    return seen


def test_a_claim_reads_the_primary_key_not_the_due_backlog(pg_url: str) -> None:
    app = Celery("plan", broker="memory://")
    durable = Durable(app, pg_url, upkeep=False)
    wf = durable.workflow("plan")

    @wf.step
    def only(n: int) -> int:
        return n

    durable.migrate()
    with durable.db.engine.begin() as conn:
        conn.exec_driver_sql(HISTORY)
    with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE durable_runs")
        conn.exec_driver_sql("ALTER TABLE durable_runs SET (autovacuum_enabled = false)")
    backlog = [durable.start(wf, {"n": i}) for i in range(400)]  # due, after the statistics
    seen = _claims_seen(durable)
    assert durable.run_message("plan", 0, backlog[0]) == "completed"  # as a worker runs a message
    assert seen, "no claim was run"
    statement, parameters = seen[0]
    with durable.db.engine.connect() as conn:
        plan = "\n".join(
            row[0]
            for row in conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, BUFFERS) " + statement, {**parameters, "p_id": backlog[-1]}
            )
        )
        conn.rollback()  # EXPLAIN ANALYZE ran the claim: leave the run to the worker
    assert "pk_durable_runs" in plan, plan
    assert "ix_durable_runs_due" not in plan, plan
    assert "Rows Removed by Filter" not in plan, plan
    durable.db.dispose()
