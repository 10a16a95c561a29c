"""The SQL that fills a volume database: every row derived from a run's number ``g``.

Each history chunk is one statement (``chunk_sql``): a ``MATERIALIZED`` CTE ``b`` of the chunk's
runs (workflow ``w``, status ``st``, the step it ended at ``last``, a retried step ``ri``, times
as epoch seconds), then data-modifying CTEs writing the runs, their steps, key rows, events and
activity from it. ``@name`` tokens are numbers filled in by ``bind``. The shapes follow the
library's writes (``store/queries.py``, ``key_rows.py``, ``activity_rows.py``) and rows written
by real runs (see ``bench/README.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHUNK = 100_000  # runs per statement (a multiple of 20 and 16: families and shared keys stay whole)
DAYS = 30
ACTIVITY_DAYS = 7  # what trim_activity_once keeps
ACTIVE = 3_000  # unfinished runs, the same at every size (capped at a twentieth of the runs)
HOT_TENANTS = 30  # sync_tenant keys whose two slots are taken, with runs parked behind them
SLOT_LIMIT = 2

# Name, steps, key template (None: unkeyed), queue; the index is ``w`` in the SQL below.
WORKFLOWS = (
    ("order", ("reserve", "charge", "ship"), "order:", "celery"),
    ("report", ("gather", "render"), None, "celery"),
    ("send_receipt", ("render_mail", "send"), "receipt:", "celery"),
    ("approval", ("ask", "apply"), "doc:", "celery"),
    ("sync_tenant", ("fetch", "diff", "write", "confirm"), None, "sync"),
    ("webhook", ("sign", "deliver"), None, "hooks"),
    ("import_batch", ("download", "split", "load", "check", "publish"), None, "imports"),
    ("import_part", ("parse", "store"), None, "imports"),
)


def _array(values: Any) -> str:
    """A SQL text[] literal of ``values``."""
    return "ARRAY[" + ", ".join(f"'{v}'" for v in values) + "]"


NAMES = _array(w[0] for w in WORKFLOWS)
QUEUES = _array(w[3] for w in WORKFLOWS)
STEP_COUNTS = "ARRAY[" + ", ".join(str(len(w[1])) for w in WORKFLOWS) + "]"
# Step names as one flat array: workflow w's step k is STEP_NAMES[w * 5 + k + 1].
STEP_NAMES = _array(n for w in WORKFLOWS for n in (*w[1], *[""] * (5 - len(w[1]))))

FUNCTIONS = f"""
CREATE FUNCTION pg_temp.h(g bigint) RETURNS bigint LANGUAGE sql IMMUTABLE
  AS 'SELECT (g * 2654435761) % 4294967296';
CREATE FUNCTION pg_temp.run_id(g bigint, at double precision) RETURNS text LANGUAGE sql IMMUTABLE
  AS $$ SELECT CAST(lpad(to_hex(floor(at * 1000)::bigint), 12, '0') || '7'
         || lpad(to_hex(g % 4096), 3, '0') || '8' || lpad(to_hex(g), 15, '0') AS uuid)::text $$;
CREATE FUNCTION pg_temp.created(g bigint, t0 double precision, step double precision)
  RETURNS double precision LANGUAGE sql IMMUTABLE
  AS 'SELECT t0 + (g - 1) * step + (pg_temp.h(g) % 997) * step / 1000.0';
CREATE FUNCTION pg_temp.wf(g bigint, h bigint) RETURNS bigint LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN g % 20 = 0 THEN 6 WHEN g % 20 IN (1, 2) AND g > 20 THEN 7
              WHEN h % 85 < 30 THEN 0 WHEN h % 85 < 47 THEN 1 WHEN h % 85 < 59 THEN 2
              WHEN h % 85 < 66 THEN 3 WHEN h % 85 < 76 THEN 4 ELSE 5 END $$;
CREATE FUNCTION pg_temp.step_name(w bigint, k bigint) RETURNS text LANGUAGE sql IMMUTABLE
  AS $$ SELECT ({STEP_NAMES})[w * 5 + k + 1] $$;
CREATE FUNCTION pg_temp.ts(e double precision) RETURNS timestamptz LANGUAGE sql IMMUTABLE
  AS 'SELECT to_timestamp(e)';
"""

TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/app/.venv/lib/python3.12/site-packages/durable_celery/core/engine.py", line 189, in _call\n'
    "    outcome.value = fn(**ctx.input)\n"
    "                    ^^^^^^^^^^^^^^^\n"
    '  File "/app/shop/workflows.py", line 57, in {step}\n'
    "    response = gateway.post(url, json=body, timeout=10)\n"
    "               ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/app/shop/gateway.py", line 112, in post\n'
    '    raise GatewayTimeout(f"{url} did not answer within {timeout} s")\n'
    "shop.gateway.GatewayTimeout: https://gateway.example.com/v2/{step} did not answer within 10 s\n"
)


def _literal(text: str) -> str:
    """``text`` as a SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _error_sql(step: str) -> str:
    """SQL of a failed attempt's error (the library's ``{type, message, traceback}``) at step ``step``."""
    return (
        "jsonb_build_object('type', 'GatewayTimeout', 'message', 'https://gateway.example.com/v2/' || "
        f"{step} || ' did not answer within 10 s', "
        f"'traceback', replace({_literal(TRACEBACK)}, '{{step}}', {step}))"
    )


INPUT = """CASE w
  WHEN 0 THEN jsonb_build_object('order_id', 'o-' || g, 'sku', (ARRAY['mug', 'tee', 'poster',
      'cap'])[h % 4 + 1],
    'quantity', 1 + h % 5, 'customer', 'c-' || (h / 5) % 50000, 'currency', 'EUR',
    'shipping', jsonb_build_object('country', (ARRAY['DE', 'FR', 'GB', 'NL'])[(h / 3) % 4 + 1],
                                   'postcode', lpad(((h / 11) % 99999)::text, 5, '0')))
  WHEN 1 THEN jsonb_build_object('day', to_char(pg_temp.ts(created), 'YYYY-MM-DD'), 'account',
      'acct-' || h % 2000,
    'format', 'pdf', 'sections', jsonb_build_array('summary', 'orders', 'refunds'))
  WHEN 2 THEN jsonb_build_object('order_id', 'o-' || g, 'email',
      'customer' || (h / 5) % 50000 || '@example.com',
    'locale', 'en-GB')
  WHEN 3 THEN jsonb_build_object('doc', 'doc-' || (g - 1) / 16, 'requested_by', 'user-' || h % 300,
    'amount_cents', h % 100000, 'reason', 'purchase order')
  WHEN 4 THEN jsonb_build_object('tenant', 't-' || (h / 41) % 500, 'full', false,
    'since', to_char(pg_temp.ts(created - 3600), 'YYYY-MM-DD"T"HH24:MI:SS"Z"'))
  WHEN 5 THEN jsonb_build_object('endpoint', 'hook-' || (h / 41) % 200, 'event', 'order.paid',
    'event_id', 'evt_' || to_hex(h) || to_hex(g))
  WHEN 6 THEN jsonb_build_object('batch', 'b-' || g, 'rows', 1000 + h % 9000,
    'source', 's3://imports/' || to_char(pg_temp.ts(created), 'YYYY/MM/DD') || '/b-' || g || '.csv')
  ELSE jsonb_build_object('batch', 'b-' || (g - g % 20), 'part', g % 20, 'rows', 500)
END"""

OUTPUT = """CASE w
  WHEN 0 THEN jsonb_build_object('order', 'o-' || g, 'tracking', 'TRK-' || upper(to_hex(h)),
    'charged_cents', 1200 * (1 + h % 5))
  WHEN 1 THEN jsonb_build_object('url', 's3://reports/acct-' || h % 2000 || '/' || g || '.pdf', 'rows',
      h % 5000)
  WHEN 2 THEN jsonb_build_object('to', 'customer' || (h / 5) % 50000 || '@example.com',
    'subject', 'Your receipt for order o-' || g, 'message_id', '<' || to_hex(h) || '@mail.example.com>')
  WHEN 3 THEN jsonb_build_object('approved_by', 'user-' || (h / 3) % 300)
  WHEN 4 THEN jsonb_build_object('changed', h % 50, 'cursor', to_hex(h * 7))
  WHEN 5 THEN jsonb_build_object('status', 200, 'attempts', 1)
  WHEN 6 THEN jsonb_build_object('parts', 2, 'rows', 1000 + h % 9000)
  ELSE jsonb_build_object('rows', 500)
END"""

CONTEXT = """CASE w
  WHEN 0 THEN jsonb_build_object('reservation', 'RES-o-' || g, 'amount_cents', 1200 * (1 + h % 5),
    'payment', 'PAY-o-' || g || '-1')
  WHEN 4 THEN jsonb_build_object('cursor', to_hex(h * 7))
  WHEN 6 THEN jsonb_build_object('parts', jsonb_build_array('2:1:1', '2:1:2'))
  ELSE '{}'::jsonb
END"""

# The run context a step found (NULL when empty): order's later steps see the reservation.
STEP_CONTEXT = """CASE WHEN w = 0 AND k = 1 THEN jsonb_build_object('reservation', 'RES-o-' || g,
    'amount_cents', 1200 * (1 + h % 5))
  WHEN w = 0 AND k = 2 THEN jsonb_build_object('reservation', 'RES-o-' || g, 'amount_cents',
      1200 * (1 + h % 5),
    'payment', 'PAY-o-' || g || '-1')
  WHEN w = 4 AND k > 0 THEN jsonb_build_object('cursor', to_hex(h * 7)) END"""

WORKER = "'worker-' || (1 + (h + k) % 4) || ':' || (2000 + (h / 53) % 40)"

STATUS = """CASE WHEN (h / 97) % 1000 < 955 THEN 'completed' WHEN (h / 97) % 1000 < 985 THEN 'failed'
  WHEN (h / 97) % 1000 < 995 THEN 'cancelled' WHEN w <> 0 THEN 'failed'
  WHEN (h / 97) % 1000 < 999 THEN 'compensated' ELSE 'compensation_failed' END"""

# One row per finished run of the chunk: its workflow w, status st, the step it ended at
# (last), the step retried after a failed attempt (ri; -2: the last step failed twice), times
# as epoch seconds (dur: a step's time, wait: an approval's wait for its event).
HISTORY_BASE = f"""
SELECT *, {INPUT} AS input,
  least(started + (last + 1) * (dur + 0.005) + CASE WHEN w = 3 AND last >= 1 THEN wait ELSE 0 END, @now - 1)
    AS finished,
  pg_temp.run_id(g, created) AS id,
  CASE WHEN w = 7 THEN pg_temp.run_id(g - g % 20, pg_temp.created(g - g % 20, @t0, @step)) END AS parent_id,
  CASE w WHEN 0 THEN 'order:' || g WHEN 2 THEN 'receipt:' || g WHEN 3 THEN 'doc:' || ((g - 1) / 16)
    END AS key,
  ({NAMES})[w + 1] AS workflow, ({QUEUES})[w + 1] AS queue, pg_temp.step_name(w, last) AS step_name,
  CASE WHEN w = 4 THEN 'tenant:' || (h / 41) % 500 END AS slot_key
FROM (
  SELECT *,
    CASE WHEN st = 'completed' THEN nsteps - 1 WHEN st LIKE 'compensat%' THEN 2
         WHEN w = 6 THEN 2 + (h / 7) % 3 ELSE (h / 7) % nsteps END AS last,
    CASE WHEN st = 'completed' AND (h / 13) % 100 < 4 THEN (h / 17) % nsteps
         WHEN st IN ('failed', 'compensated', 'compensation_failed') THEN -2 ELSE -1 END AS ri,
    created + (5 + h % 300) / 1000.0 AS started, (20 + (h / 31) % 400) / 1000.0 AS dur,
    CASE WHEN w = 3 THEN least(((h / 37) % 240) * 60.0, greatest(@now - 5 - created, 0)) ELSE 0 END AS wait
  FROM (
    SELECT *, ({STEP_COUNTS})[w + 1] AS nsteps, {STATUS} AS st
    FROM (SELECT g, h, pg_temp.wf(g, h) AS w, pg_temp.created(g, @t0, @step) AS created
          FROM (SELECT g, pg_temp.h(g) AS h FROM generate_series(@lo::bigint, @hi::bigint) g) x) y
  ) z
) a
"""

CANCELLED = """'{"type": "Cancelled", "message": "cancelled", "traceback": null}'::jsonb"""
FAILED_HERE = "k = last AND st <> 'completed'"

HISTORY_STEPS = f"""
INSERT INTO durable_steps (run_id, step_index, phase, name, attempt, status, output, error, context,
                           worker, logs, started_at, finished_at)
SELECT id, k, 'step', pg_temp.step_name(w, k), CASE WHEN k = ri OR (k = last AND ri = -2) THEN 2 ELSE 1 END,
  CASE WHEN {FAILED_HERE} THEN 'failed' ELSE 'completed' END,
  CASE WHEN NOT ({FAILED_HERE})
       THEN jsonb_build_object('step', pg_temp.step_name(w, k), 'ok', true, 'ms', (dur * 1000)::int) END,
  CASE WHEN {FAILED_HERE} THEN {_error_sql("pg_temp.step_name(w, k)")} END,
  {STEP_CONTEXT}, {WORKER}, '[]'::jsonb, pg_temp.ts(s0), pg_temp.ts(s0 + dur)
FROM (SELECT b.*, k, started + k * (dur + 0.005) + CASE WHEN w = 3 AND k >= 1 THEN wait ELSE 0 END AS s0
      FROM b CROSS JOIN LATERAL generate_series(0, last - (st = 'cancelled')::int) k) s
UNION ALL
SELECT id, k, 'step', pg_temp.step_name(w, k), 1, 'failed', NULL, {_error_sql("pg_temp.step_name(w, k)")},
  NULL, {WORKER}, '[]'::jsonb, pg_temp.ts(started + k * dur), pg_temp.ts(started + k * dur + 0.01)
FROM (SELECT b.*, CASE WHEN ri >= 0 THEN ri ELSE last END AS k FROM b WHERE ri >= 0 OR ri = -2) r
UNION ALL
SELECT id, k, 'compensate', (ARRAY['release_stock', 'refund'])[k + 1], 1,
  CASE WHEN st = 'compensation_failed' AND k = 1 THEN 'failed' ELSE 'completed' END,
  NULL, NULL, NULL, {WORKER}, '[]'::jsonb, pg_temp.ts(finished - 0.1 * (k + 1)),
      pg_temp.ts(finished - 0.1 * k)
FROM b CROSS JOIN generate_series(0, 1) k WHERE st LIKE 'compensat%'
"""

HISTORY_KEYS = """
INSERT INTO durable_keys (workflow, key, holder_id, taken_at)
SELECT DISTINCT ON (w, key) workflow, key, id, pg_temp.ts(created) FROM b WHERE key IS NOT NULL
ORDER BY w, key, g DESC
"""

HISTORY_EVENTS = """
INSERT INTO durable_events (run_id, name, payload, received, timed_out, created_at)
SELECT id, 'approved',
  CASE WHEN (h / 43) % 50 <> 0 THEN jsonb_build_object('by', 'user-' || (h / 3) % 300, 'comment',
      'looks right') END,
  true, (h / 43) % 50 = 0, pg_temp.ts(started + dur + wait)
FROM b WHERE w = 3 AND last >= 1
"""

# Activity is kept a week (trim_activity_once): only entries after @since are written.
ACTIVITY = """
INSERT INTO durable_activity (kind, run_id, workflow, key, details, at)
SELECT kind, id, workflow, akey, details, pg_temp.ts(at) FROM (
  SELECT 'key_duplicate' AS kind, id, workflow, key AS akey, started + 0.5 AS at,
    jsonb_build_object('key', key, 'workflow', workflow, 'policy', 'use_existing', 'outcome', 'use_existing',
      'holder_status', 'running', 'input_changed', (h / 59) % 3 = 0,
      'input', CASE WHEN (h / 59) % 3 = 0 THEN input || '{"note": "second click"}'::jsonb ELSE input END)
      AS details
  FROM b WHERE key IS NOT NULL AND (h / 19) % 100 < 8
  UNION ALL
  SELECT 'slot_wait', id, workflow, NULL, created + 0.01,
    jsonb_build_object('key', slot_key, 'limit', 2, 'in_use', 2, 'workflow', workflow)
  FROM b WHERE w = 4 AND ((h / 23) % 100 < 15 OR st = 'pending')
  UNION ALL
  SELECT 'cancelled', id, workflow, key, finished,
    jsonb_build_object('key', key, 'workflow', workflow, 'by', 'ops@example.com', 'from', 'cli')
  FROM b WHERE st = 'cancelled'
  UNION ALL
  SELECT 'stale_recovered', id, workflow, key, started + 300,
    jsonb_build_object('key', key, 'workflow', workflow, 'locked_by', 'worker-2:2011', 'losses', 1,
        'failed', false)
  FROM b WHERE (h / 71) % 2000 = 0
) a WHERE at >= @since AND at <= @now ORDER BY at
"""

# Optional columns (later revisions): written when the database has them.
OPTIONAL = {
    "tags": "CASE WHEN w = 4 THEN jsonb_build_object('tenant', 't-' || (h / 41) % 500) END",
    "progress": "CASE WHEN w = 6 THEN jsonb_build_object('done', last + 1, 'of', nsteps) END",
    "line_at": "pg_temp.ts(created)",  # a run's place in its limit's line: its start (priority 0)
}

HISTORY_RUNS = f"""
INSERT INTO durable_runs (id, workflow, status, input, context, output, error, key, parent_id,
    parent_ref, queue,
  step_index, step_name, attempt, fence, deadline_at, wait_name, slot_key, rate_key,
  created_at, started_at, finished_at @optional_columns)
SELECT id, workflow, st, input, {CONTEXT}, CASE WHEN st = 'completed' THEN {OUTPUT} END,
  CASE WHEN st = 'cancelled' THEN {CANCELLED} WHEN st <> 'completed' THEN {_error_sql("step_name")} END,
  key, parent_id, CASE WHEN w = 7 THEN '2:1:' || g % 20 END, queue,
  last, step_name, CASE WHEN ri = last OR ri = -2 THEN 2 ELSE 1 END,
  last + 1 + (ri <> -1)::int + CASE WHEN st LIKE 'compensat%' THEN 2 ELSE 0 END,
  CASE WHEN w = 4 THEN pg_temp.ts(started + 3600) END,
  CASE w WHEN 3 THEN 'approved' WHEN 6 THEN 'durable:children' END,
  slot_key, CASE WHEN w = 5 THEN 'hook:' || (h / 41) % 200 END,
  pg_temp.ts(created), pg_temp.ts(started), pg_temp.ts(finished) @optional_values
FROM b
"""


def chunk_sql(base: str, parts: tuple[str, ...], optional: tuple[str, ...]) -> str:
    """One statement: ``base`` materialized as ``b``, then each of ``parts`` as a data-modifying
    CTE; ``optional`` are the optional columns the database has."""
    ctes = ",\n".join(f"w{n} AS ({part.strip()})" for n, part in enumerate(parts))
    text = f"WITH b AS MATERIALIZED ({base.strip()}),\n{ctes}\nSELECT count(*) FROM b"
    columns = "".join(f", {name}" for name in optional)
    values = "".join(f", {OPTIONAL[name]}" for name in optional)
    return text.replace("@optional_columns", columns).replace("@optional_values", values)


def bind(sql: str, **values: float) -> str:
    """``sql`` with each ``@name`` replaced by the number given (numbers only: no quoting needed)."""
    for name in sorted(values, key=len, reverse=True):
        value = values[name]
        sql = sql.replace(f"@{name}", str(value) if isinstance(value, int) else repr(float(value)))
    return sql


@dataclass(frozen=True)
class Mix:
    """How the active runs divide: the last ``j`` (1-based, within the active runs) of each class."""

    pending: int
    running: int
    parked: int
    event: int
    sleep: int
    backoff: int
    family: int
    compensating: int
    hot: int  # sync_tenant keys with both slots taken (by running runs) and runs parked behind them

    @classmethod
    def of(cls, active: int) -> Mix:
        """The mix of ``active`` unfinished runs: a ready backlog, steps running, runs parked for a
        slot, waiting for events and sleeping, retries backing off, parents waiting for children."""
        shares = (0.18, 0.10, 0.22, 0.30, 0.10, 0.04, 0.045)
        ends, total = [], 0
        for share in shares:
            total += max(1, round(active * share))
            ends.append(total)
        family = ends[6] - ends[5]
        ends[6] = ends[5] + max(3, family - family % 3)  # whole families: a parent and two children
        last = max(active, ends[6] + 1)
        hot = max(1, min(HOT_TENANTS, (ends[1] - ends[0]) // SLOT_LIMIT))
        return cls(*ends, last, hot)  # type: ignore[call-arg]


ACTIVE_CLASS = """CASE WHEN j <= @pending THEN 'pending' WHEN j <= @running THEN 'running'
  WHEN j <= @parked THEN 'parked' WHEN j <= @event THEN 'event' WHEN j <= @sleep THEN 'sleep'
  WHEN j <= @backoff THEN 'backoff' WHEN j <= @family THEN 'family' ELSE 'compensating' END"""

# The workflow of an active run by its class (a slot holder is a sync_tenant run).
ACTIVE_W = """CASE cls WHEN 'pending' THEN (ARRAY[0, 1, 2, 5])[h % 4 + 1]
  WHEN 'running' THEN CASE WHEN j - @pending <= @hot * 2 THEN 4 ELSE (ARRAY[0, 1, 5])[h % 3 + 1] END
  WHEN 'parked' THEN 4 WHEN 'event' THEN 3 WHEN 'sleep' THEN 1 WHEN 'backoff' THEN 0
  WHEN 'family' THEN CASE WHEN (j - @backoff) % 3 = 1 THEN 6 ELSE 7 END ELSE 0 END"""

# Seconds before now it was created: running and ready runs are minutes old, waits days.
ACTIVE_AGE = """CASE cls WHEN 'event' THEN 1 + h % (7 * 86400) WHEN 'sleep' THEN 1 + h % 86400
  WHEN 'parked' THEN 1 + h % 1800 WHEN 'family' THEN 700 - (j - @backoff) * 0.1 ELSE 1 + h % 120 END"""

ACTIVE_BASE = f"""
SELECT *, {INPUT} AS input, pg_temp.run_id(g, created) AS id,
  CASE WHEN w = 7 THEN pg_temp.run_id(g - fam, created - fam * 0.1) END AS parent_id,
  CASE w WHEN 0 THEN 'order:a' || g WHEN 2 THEN 'receipt:a' || g WHEN 3 THEN 'doc:a' || g END AS key,
  ({NAMES})[w + 1] AS workflow, ({QUEUES})[w + 1] AS queue, pg_temp.step_name(w, last) AS step_name,
  CASE WHEN w = 4 THEN 'tenant:' || CASE WHEN cls = 'parked' OR cls = 'running' THEN j % @hot
                                         ELSE (h / 41) % 500 END END AS slot_key,
  created + 0.01 AS started, 0.05 AS dur, 0 AS wait, NULL::float AS finished, -1 AS ri,
  ({STEP_COUNTS})[w + 1] AS nsteps
FROM (
  SELECT *, @now - ({ACTIVE_AGE}) AS created,
    CASE cls WHEN 'pending' THEN 'pending' WHEN 'parked' THEN 'pending' WHEN 'event' THEN 'waiting'
      WHEN 'sleep' THEN 'waiting' WHEN 'family' THEN CASE WHEN w = 6 THEN 'waiting' ELSE 'pending' END
      WHEN 'compensating' THEN 'compensating' ELSE 'running' END AS st,
    CASE WHEN cls IN ('pending', 'parked', 'event') OR w = 7 THEN 0 WHEN w = 6 THEN 2 ELSE 1 END AS last,
    CASE WHEN w = 7 THEN 1 + (j - @backoff - 1) % 3 - 1 ELSE 0 END AS fam
  FROM (SELECT *, {ACTIVE_W} AS w FROM (SELECT *, {ACTIVE_CLASS} AS cls
        FROM (SELECT g, pg_temp.h(g) AS h, g - @H AS j FROM generate_series(@H + 1, @N) g) x) y) z
) a
"""

ACTIVE_RUNS = f"""
INSERT INTO durable_runs (id, workflow, status, input, context, key, parent_id, parent_ref, queue, step_index,
  step_name, attempt, fence, locked_by, heartbeat_at, due_at, published, deadline_at, wait_name, wait_until,
  slot_key, flow_wait, created_at, started_at @optional_columns)
SELECT id, workflow, st, input, CASE WHEN last > 0 THEN {CONTEXT} ELSE '{{}}'::jsonb END, key, parent_id,
  CASE WHEN w = 7 THEN '2:1:' || fam END, queue, last, step_name, CASE WHEN cls = 'backoff' THEN 2 ELSE 1 END,
  CASE WHEN cls IN ('pending', 'parked') OR w = 7 THEN 0 ELSE last + 1 END,
  CASE WHEN cls IN ('running', 'compensating') THEN 'worker-' || (1 + h % 4) || ':' || (2000 + h % 40) END,
  CASE WHEN cls IN ('running', 'compensating') THEN pg_temp.ts(@now - h % 10) END,
  pg_temp.ts(CASE cls WHEN 'pending' THEN @now - h % 60
    WHEN 'family' THEN CASE WHEN w = 7 THEN @now - h % 60 END
    WHEN 'event' THEN created + 30 * 86400 WHEN 'sleep' THEN @now + 60 + h % 3600
    WHEN 'backoff' THEN @now + 30 + h % 300 END),
  cls = 'pending' OR w = 7,
  CASE WHEN w = 4 AND cls = 'running' THEN pg_temp.ts(started + 3600) END,
  CASE cls WHEN 'event' THEN 'approved' WHEN 'sleep' THEN 'durable:sleep:1:1:1'
    WHEN 'family' THEN CASE WHEN w = 6 THEN 'durable:children' END END,
  pg_temp.ts(CASE cls WHEN 'event' THEN created + 30 * 86400 WHEN 'sleep' THEN @now + 60 + h % 3600 END),
  slot_key, CASE WHEN cls = 'parked' THEN 'slot' END,
  pg_temp.ts(created), CASE WHEN cls NOT IN ('pending', 'parked') AND w <> 7 THEN pg_temp.ts(started) END
  @optional_values
FROM b
"""

ACTIVE_STEPS = f"""
INSERT INTO durable_steps (run_id, step_index, phase, name, attempt, status, output, error, context,
                           worker, logs, started_at, finished_at)
SELECT id, k, 'step', pg_temp.step_name(w, k), 1, 'completed',
  jsonb_build_object('step', pg_temp.step_name(w, k), 'ok', true, 'ms', 50), NULL, {STEP_CONTEXT},
  {WORKER}, '[]'::jsonb, pg_temp.ts(started + k * 0.06), pg_temp.ts(started + k * 0.06 + 0.05)
FROM b CROSS JOIN LATERAL generate_series(0, last - 1) k
UNION ALL
SELECT id, 1, 'step', pg_temp.step_name(w, 1), 1, 'failed', NULL,
  {_error_sql("pg_temp.step_name(w, 1)")}, NULL,
  'worker-1:2001', '[]'::jsonb, pg_temp.ts(started + 0.06), pg_temp.ts(started + 0.11)
FROM b WHERE cls = 'backoff'
"""

ACTIVE_KEYS = """
INSERT INTO durable_keys (workflow, key, holder_id, taken_at)
SELECT workflow, key, id, pg_temp.ts(created) FROM b WHERE key IS NOT NULL
"""

EXTRAS = """
INSERT INTO durable_nodes (name, queues, pid, draining, started_at, seen_at, steps)
SELECT 'worker-' || n || '@bench', CAST(@queues AS jsonb), 2000 + n, false, now() - interval '3 days', now(),
  CAST(@steps AS jsonb)
FROM generate_series(1, 4) n;
INSERT INTO durable_queue_samples (queue, ready, running, waiting, oldest_ready_at, at)
SELECT q, (m * 7) % 40, (m * 3) % 12, (m * 11) % 300,
  CASE WHEN (m * 7) % 40 > 0 THEN pg_temp.ts(@now - m * 60 - 20) END, pg_temp.ts(@now - m * 60)
FROM jsonb_array_elements_text(CAST(@queues AS jsonb)) q CROSS JOIN generate_series(1, 7 * 1440) m;
INSERT INTO durable_schedules (name, workflow, key, schedule, input, enabled, failures, last_outcome,
                               last_fire_at, created_at, updated_at)
VALUES ('nightly-report', 'report', 'report:nightly', '0 3 * * *', '{"day": "yesterday"}', true, 0, 'started',
        now() - interval '20 hours', now() - interval '90 days', now() - interval '20 hours'),
       ('tenant-sync', 'sync_tenant', 'tenant:0', '*/15 * * * *', '{"tenant": "t-0"}', true, 0, 'started',
        now() - interval '5 minutes', now() - interval '90 days', now() - interval '5 minutes'),
       ('hourly-import', 'import_batch', 'import:hourly', '0 * * * *', '{"batch": "hourly"}', true, 1,
           'failed',
        now() - interval '30 minutes', now() - interval '60 days', now() - interval '30 minutes'),
       ('old-webhook', 'webhook', NULL, '0 0 * * 0', NULL, false, 5, 'failed',
        now() - interval '9 days', now() - interval '200 days', now() - interval '9 days');
INSERT INTO durable_activity (kind, run_id, workflow, key, details, at)
SELECT 'runs_pruned', NULL, NULL, NULL,
  jsonb_build_object('key', NULL, 'workflow', NULL, 'rule', 'completed', 'statuses',
      jsonb_build_array('completed'),
                     'older_than', 2592000, 'runs', @pruned), pg_temp.ts(@now - m * 3600)
FROM generate_series(168, 1, -1) m;
"""
