"""Every statement the dashboard's pages and ``status_summary()`` (``durable status``) run is
served by an index: with 500,000 finished runs (and a step each) stored, and 10,000 runs parked
by flow control, EXPLAIN of each shows no sequential scan of durable_runs or durable_steps."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import event
from starlette.testclient import TestClient

from durable_celery import Durable
from durable_celery.web import create_app

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(600)]

HISTORY = 500_000

FILL = [
    f"""
    INSERT INTO durable_runs (id, workflow, status, input, context, key, queue, created_at, started_at,
                              finished_at, error)
    SELECT gen_random_uuid()::text,
           (ARRAY['bulk', 'quick', 'invoice'])[1 + mod(i, 3)],
           CASE WHEN mod(i, 10) = 0 THEN 'failed' ELSE 'completed' END,
           jsonb_build_object('n', i), '{{}}'::jsonb,
           CASE WHEN mod(i, 5) = 0 THEN 'bulk:' || i END,
           'celery',
           now() - make_interval(secs => i), now() - make_interval(secs => i),
           now() - make_interval(secs => i) + interval '1 second',
           CASE WHEN mod(i, 10) = 0 THEN '{{"type": "RuntimeError", "message": "boom"}}'::jsonb END
    FROM generate_series(1, {HISTORY}) AS i
    """,
    """
    INSERT INTO durable_steps (run_id, step_index, phase, name, attempt, status, started_at, finished_at)
    SELECT id, 0, 'step', 'only', 1, status, started_at, finished_at FROM durable_runs
    """,
    """
    INSERT INTO durable_keys (workflow, key, holder_id, taken_at)
    SELECT workflow, key, id, created_at FROM durable_runs WHERE key IS NOT NULL
    """,
    """
    INSERT INTO durable_activity (kind, run_id, workflow, key, details, at)
    SELECT 'key_duplicate', k.holder_id, k.workflow, k.key,
           jsonb_build_object('key', k.key, 'workflow', k.workflow, 'outcome', 'use_existing',
                              'input_changed', true, 'input', jsonb_build_object('n', -1)),
           now() - interval '1 minute'
    FROM durable_keys k ORDER BY k.taken_at DESC LIMIT 2000
    """,
    # A flow-limited workflow: 50,000 finished runs with their flow keys, and 10,000 parked
    # (half for a concurrency slot, half by the throttle) over 100 keys each.
    """
    INSERT INTO durable_runs (id, workflow, status, input, context, queue, created_at, started_at,
                              finished_at, slot_key, throttle_key, rate_key)
    SELECT gen_random_uuid()::text, 'metered', 'completed', jsonb_build_object('n', i), '{}'::jsonb,
           'celery', now() - make_interval(secs => i), now() - make_interval(secs => i),
           now() - make_interval(secs => i) + interval '1 second',
           't:' || mod(i, 100), 'c:' || mod(i, 100), 'u:' || mod(i, 100)
    FROM generate_series(1, 50000) AS i
    """,
    """
    INSERT INTO durable_runs (id, workflow, status, input, context, queue, created_at, slot_key,
                              throttle_key, rate_key, flow_wait, due_at, published)
    SELECT gen_random_uuid()::text, 'metered', 'pending', jsonb_build_object('n', i), '{}'::jsonb,
           'celery', now() - make_interval(secs => i / 100.0),
           't:' || mod(i, 100), 'c:' || mod(i, 100), 'u:' || mod(i, 100),
           CASE WHEN mod(i, 2) = 0 THEN 'slot' ELSE 'throttle' END,
           CASE WHEN mod(i, 2) = 0 THEN NULL ELSE now() + interval '1 minute' END, false
    FROM generate_series(1, 10000) AS i
    """,
]


def _fill(durable: Durable) -> None:
    with durable.db.engine.begin() as conn:
        for statement in FILL:
            conn.exec_driver_sql(statement)
    with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")


def test_pages_use_indexes_with_500k_finished_runs(pg_url: str) -> None:
    durable = Durable(Celery("bulk", broker="memory://"), pg_url, upkeep=False, prune={"completed": "30d"})
    quick = durable.workflow("quick", reuse="after_close")

    @quick.step
    def only(n: int) -> int:
        return n

    metered = durable.workflow(
        "metered",
        concurrency={"limit": 2, "key": "t:{n}"},
        throttle={"limit": 5, "period": 60, "key": "c:{n}"},
        rate_limit={"limit": 100, "period": 3600, "key": "u:{n}"},
    )
    metered.step(only, name="only")

    started = time.monotonic()
    _fill(durable)
    live = durable.start("quick", {"n": 1}, key="live:1")
    with durable.db.engine.connect() as conn:
        some = conn.exec_driver_sql("SELECT id FROM durable_runs WHERE key IS NOT NULL LIMIT 1").scalar()
        slot_wait, throttled = (
            conn.exec_driver_sql(
                f"SELECT id FROM durable_runs WHERE flow_wait = '{wait}' AND finished_at IS NULL LIMIT 1"
            ).scalar()
            for wait in ("slot", "throttle")
        )
    fill_seconds = time.monotonic() - started

    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if not many and statement.lstrip().upper().startswith(("SELECT", "WITH")):
            seen.append((statement, parameters))

    event.listen(durable.db.engine, "before_cursor_execute", record)
    client = TestClient(create_app(durable, token="T"))
    pages = [
        "/",
        "/runs",
        "/runs?page=3",
        "/runs?status=failed",
        "/runs?workflow=bulk",
        "/runs?workflow=bulk&status=completed",
        "/runs?q=key:bulk:500",
        "/runs?key=bulk:500&status=completed",
        f"/runs/{some}",
        f"/runs/{live}",
        "/keys",
        "/keys?prefix=bulk:12",
        "/keys?workflow=bulk&prefix=bulk:3",
        "/workflows/bulk",
        "/queues",
        "/schedules",
        "/settings",
        "/api/runs?limit=100",
        f"/api/runs/{some}",
        "/api/keys?workflow=quick",
        "/api/queues",
        "/flow",
        "/flow?workflow=metered",
        "/api/flow",
        "/workflows/metered",
        f"/runs/{slot_wait}",
        f"/runs/{throttled}",
    ]
    timings = {}
    try:
        for path in pages:
            began = time.monotonic()
            assert client.get(path).status_code == 200, path
            timings[path] = time.monotonic() - began
        began = time.monotonic()
        summary = durable.status_summary()  # what `durable status` shows: counts stop at 10,000
        timings["status_summary()"] = time.monotonic() - began
        assert summary["runs"]["completed"] == summary["runs_counted_to"] == 10_000
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", record)

    scans = []
    with durable.db.engine.connect() as conn:
        for statement, parameters in seen:
            plan = "\n".join(conn.exec_driver_sql("EXPLAIN " + statement, parameters).scalars())
            if re.search(r"Seq Scan on durable_(runs|steps)\b", plan):
                scans.append(f"{statement}\n{plan}")
    durable.db.dispose()
    assert len(seen) > 30
    assert not scans, "sequential scans:\n\n" + "\n\n".join(scans)
    slowest = max(timings, key=timings.__getitem__)
    print(f"filled in {fill_seconds:.1f}s; slowest page {slowest} {timings[slowest] * 1000:.0f} ms")
    assert timings[slowest] < 5.0, timings
