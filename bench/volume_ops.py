"""What the volume bench times (and the plan guard explains): every public read, CLI report,
dashboard page and JSON route, the metrics scrape and every upkeep pass, each an ``Op``.

Each op calls the library's public API or its upkeep's ``*_once`` passes, never the statements
in ``durable_celery/store`` (they are being rewritten while this is measured): what a statement
looks like is captured with SQLAlchemy's ``before_cursor_execute`` while the op runs
(``Capture``). The runs an op reads (a completed keyed run, a failed one, a waiting one, a parent
with children, a hot key) are picked once per database by ``pick_sample``.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from sqlalchemy import event, text

from durable_celery import Durable

# Ops grouped as the report shows them; the goals of issue 42 are per group (volume_time.py).
GROUPS = ("read", "cli", "page", "api", "metrics", "upkeep", "admin")

SAMPLE = {
    "completed": "SELECT id, key FROM durable_runs WHERE workflow = 'order' AND status = 'completed' "
    "AND created_at < now() - interval '15 days' ORDER BY created_at DESC LIMIT 1",
    "failed": "SELECT id, key FROM durable_runs WHERE workflow = 'order' AND status = 'failed' "
    "AND created_at < now() - interval '10 days' ORDER BY created_at DESC LIMIT 1",
    "waiting": "SELECT id, key FROM durable_runs WHERE workflow = 'approval' AND status = 'waiting' "
    "ORDER BY created_at LIMIT 1",
    "parent": "SELECT id, key FROM durable_runs WHERE workflow = 'import_batch' AND status = 'completed' "
    "AND created_at < now() - interval '5 days' ORDER BY created_at DESC LIMIT 1",
    "parked": "SELECT id, key FROM durable_runs WHERE flow_wait = 'slot' AND finished_at IS NULL "
    "ORDER BY created_at LIMIT 1",
    "readded": "SELECT run_id AS id, key FROM durable_activity WHERE kind = 'key_duplicate' "
    "ORDER BY id DESC LIMIT 1",
}


@dataclass(frozen=True)
class Sample:
    """Runs and keys an op reads, picked once per database."""

    completed: str
    completed_key: str
    failed: str
    waiting: str
    parent: str
    parked: str
    readded: str
    readded_key: str


def pick_sample(durable: Durable) -> Sample:
    """Pick the runs the ops read (untimed): each an index lookup."""
    found: dict[str, Any] = {}
    with durable.db.engine.connect() as conn:
        for name, sql in SAMPLE.items():
            row = conn.execute(text(sql)).first()
            if row is None:
                raise RuntimeError(f"no {name} run in {durable.db.masked_url}: is it a volume database?")
            found[name], found[f"{name}_key"] = row.id, row.key
    return Sample(**{f: found[f] for f in Sample.__dataclass_fields__})


@dataclass
class Target:
    """One database as the ops see it: its Durable, its dashboard client, its sample."""

    durable: Durable
    sample: Sample
    label: str
    runs: int = 0
    database: str = ""
    _client: Any = None
    slot_waker: Any = None

    @property
    def client(self) -> Any:
        """A TestClient of the dashboard (read-only: no token)."""
        if self._client is None:
            from starlette.testclient import TestClient

            from durable_celery.web import create_app

            self._client = TestClient(create_app(self.durable))
        return self._client


@dataclass(frozen=True)
class Op:
    """A timed operation: ``call(target)`` does it once."""

    name: str
    group: str
    call: Callable[[Target], Any]


def _get(path: str) -> Callable[[Target], Any]:
    """A dashboard GET of ``path`` (``{completed}`` etc. filled from the sample); 200 expected."""

    def call(t: Target) -> Any:
        """Do the op once on ``t``."""
        response = t.client.get(path.format(**vars(t.sample)))
        if response.status_code != 200:
            raise RuntimeError(f"GET {path}: {response.status_code} {response.text[:200]}")
        return response

    return call


def _cli(*args: str, ok: tuple[int, ...] = (0,)) -> Callable[[Target], Any]:
    """``celery -A app durable <args>`` in this process (click's CliRunner); an exit code in
    ``ok`` expected (``doctor`` exits 1 when it has findings)."""

    def call(t: Target) -> Any:
        """Do the op once on ``t``."""
        from click.testing import CliRunner

        from durable_celery.cli import durable as durable_cli

        filled = [a.format(**vars(t.sample)) for a in args]
        result = CliRunner().invoke(durable_cli, filled, obj=SimpleNamespace(app=t.durable.app))
        if result.exit_code not in ok:
            raise RuntimeError(f"durable {' '.join(filled)}: exit {result.exit_code}: {result.output[-300:]}")
        return result.output

    return call


def _scrape(t: Target) -> bytes:
    """One Prometheus scrape that reads the database (the collector's cache emptied first)."""
    metrics = t.durable.metrics
    collector = getattr(metrics, "collector", None)
    if collector is not None:
        collector.invalidate()
    body = metrics.exposition()
    if b"durable_database_up 1.0" not in body:
        raise RuntimeError("the metrics scrape could not read the database")
    return body


def _pass(name: str) -> Callable[[Target], Any]:
    """One upkeep pass, as a worker's upkeep thread makes it."""

    def call(t: Target) -> Any:
        """Do the op once on ``t``."""
        return UPKEEP[name](t)

    return call


def _relay(t: Target) -> Any:
    """A relay pass (worker/relay.py), as the upkeep's relay thread makes it."""
    from durable_celery.worker.relay import relay_once

    return relay_once(t.durable.runtime, t.durable.app)


def _slot_wake(t: Target) -> Any:
    """A pass of the flow waker (SlotWaker), one kept per database as a worker keeps one."""
    from durable_celery.core.flow import SlotWaker

    if t.slot_waker is None:  # one per worker: its passes go on from key to key
        t.slot_waker = SlotWaker(t.durable.runtime)
    return t.slot_waker.wake_slots_once()


def _sweep(name: str) -> Callable[[Target], Any]:
    """A pass of ``core/sweeps.py`` by name, given the runtime (or the database, for the trim)."""

    def call(t: Target) -> Any:
        """Do the op once on ``t``."""
        from durable_celery.core import sweeps

        fn = getattr(sweeps, name)
        return fn(t.durable.db if name == "trim_activity_once" else t.durable.runtime)

    return call


def _restore_schedules(t: Target) -> Any:
    """The pass that restores schedules missing from the beat scheduler."""
    from durable_celery.schedules import restore_schedules_once

    return restore_schedules_once(t.durable.runtime, t.durable.app)


def _prune_some(t: Target) -> Any:
    """One prune batch per rule, as upkeep runs it (the bench's rules: nothing due)."""
    from durable_celery.core import prune

    return prune.prune_some(t.durable.db, t.durable.settings.prune)


def _paused_queues(t: Target) -> Any:
    """The paused queues, read by every worker's relay thread each pass."""
    from durable_celery.core import queues

    return queues.paused_queues(t.durable.db)


UPKEEP: dict[str, Callable[[Target], Any]] = {
    "relay_once": _relay,
    "wake_slots_once (SlotWaker)": _slot_wake,
    "sweep_stale_once": _sweep("sweep_stale_once"),
    "fail_overdue_once": _sweep("fail_overdue_once"),
    "wake_missed_once": _sweep("wake_missed_once"),
    "cancel_orphans_once": _sweep("cancel_orphans_once"),
    "sample_queues_once": _sweep("sample_queues_once"),
    "trim_activity_once": _sweep("trim_activity_once"),
    "restore_schedules_once": _restore_schedules,
    "prune_some (nothing due)": _prune_some,
    "paused_queues": _paused_queues,
}


def _reads() -> list[Op]:
    """The public reads of ``Durable``."""
    calls: list[tuple[str, Callable[[Target], Any]]] = [
        ("list_runs()", lambda t: t.durable.list_runs()),
        ("list_runs(status=failed)", lambda t: t.durable.list_runs(status="failed")),
        ("list_runs(status=waiting)", lambda t: t.durable.list_runs(status="waiting")),
        ("list_runs(workflow=order)", lambda t: t.durable.list_runs(workflow="order")),
        ("list_runs(workflow, status)", lambda t: t.durable.list_runs(workflow="order", status="completed")),
        ("list_runs(key=...)", lambda t: t.durable.list_runs(key=t.sample.completed_key)),
        ("list_runs(after=15 days back)", lambda t: t.durable.list_runs(after=t.sample.completed)),
        ("get_run", lambda t: t.durable.get_run(t.sample.completed)),
        ("list_steps", lambda t: t.durable.list_steps(t.sample.failed)),
        ("list_children", lambda t: t.durable.list_children(t.sample.parent)),
        ("list_keys()", lambda t: t.durable.list_keys()),
        ("list_keys(workflow=order, 50)", lambda t: t.durable.list_keys("order", 50)),
        ("list_keys(prefix=...)", lambda t: t.durable.list_keys(prefix=t.sample.completed_key[:-2])),
        ("activity()", lambda t: t.durable.activity()),
        ("activity(kinds=key_duplicate)", lambda t: t.durable.activity(kinds=["key_duplicate"])),
        ("activity(run_id=...)", lambda t: t.durable.activity(run_id=t.sample.readded)),
        ("activity(workflow=order)", lambda t: t.durable.activity(workflow="order")),
        ("list_pending_inputs()", lambda t: t.durable.list_pending_inputs()),
        ("stats.keys()", lambda t: t.durable.stats.keys()),
        ("stats.keys(workflow=order)", lambda t: t.durable.stats.keys(workflow="order")),
        ("stats.queues()", lambda t: t.durable.stats.queues()),
        ("status_summary()", lambda t: t.durable.status_summary()),
        ("doctor()", lambda t: t.durable.doctor()),
        ("count_runs()", lambda t: t.durable.count_runs()),
        ("list_nodes()", lambda t: t.durable.list_nodes()),
        ("list_schedules()", lambda t: t.durable.list_schedules()),
        ("pending_migrations()", lambda t: t.durable.pending_migrations()),
    ]
    return [Op(name, "read", call) for name, call in calls]


CLI = (
    ("runs",),
    ("runs", "-s", "failed"),
    ("runs", "-w", "order"),
    ("runs", "-k", "{completed_key}"),
    ("show", "{parent}"),
    ("keys",),
    ("keys", "-w", "order"),
    ("flow",),
    ("status",),
    ("doctor",),
    ("queues",),
    ("nodes",),
    ("schedules",),
    ("cleanup", "--older-than", "60d", "--dry-run"),
)

PAGES = (
    "/",
    "/runs",
    "/runs?status=failed",
    "/runs?workflow=order",
    "/runs?q=key:{completed_key}",
    "/runs?page=20",
    "/runs?after={completed}",
    "/runs/{completed}",
    "/runs/{waiting}",
    "/runs/{parent}",
    "/runs/{readded}",
    "/keys",
    "/keys?workflow=order",
    "/flow",
    "/workflows/order",
    "/workflows/sync_tenant",
    "/queues",
    "/schedules",
    "/settings",
)

API = (
    "/api/overview",
    "/api/runs",
    "/api/runs?status=failed",
    "/api/runs?after={completed}",
    "/api/runs/{completed}",
    "/api/keys",
    "/api/flow",
    "/api/queues",
    "/api/schedules",
    "/api/settings",
)


def operations() -> list[Op]:
    """Every op, in the order the report lists them (admin changelists: volume_admin.py)."""
    ops = _reads()
    ops += [
        Op("durable " + " ".join(args), "cli", _cli(*args, ok=(0, 1) if args == ("doctor",) else (0,)))
        for args in CLI
    ]
    ops += [Op("GET " + path, "page", _get(path)) for path in PAGES]
    ops += [Op("GET " + path, "api", _get(path)) for path in API]
    ops.append(Op("metrics scrape", "metrics", _scrape))
    ops += [Op(name, "upkeep", _pass(name)) for name in UPKEEP]
    return ops


@dataclass
class Capture:
    """The statements an op sends: SQLAlchemy's ``before_cursor_execute`` on the engines given,
    recording only while ``active`` (the listener stays; each statement and its parameters)."""

    engines: list[Any]
    statements: list[tuple[str, Any]] = field(default_factory=list)
    active: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        """Listen on every engine given."""
        for engine in self.engines:
            event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
    ) -> None:
        """Keep one statement and its parameters (the first set of an executemany)."""
        if self.active:
            first = parameters[0] if many and parameters else parameters
            with self.lock:
                self.statements.append((statement, first))

    @contextlib.contextmanager
    def during(self) -> Iterator[list[tuple[str, Any]]]:
        """Record the statements sent inside the block; yields the list they go in."""
        with self.lock:
            self.statements = []
        self.active = True
        try:
            yield self.statements
        finally:
            self.active = False

    def close(self) -> None:
        """Remove the listeners."""
        for engine in self.engines:
            event.remove(engine, "before_cursor_execute", self._seen)


EXPLAINED = ("select", "with", "update", "delete", "insert")


def explainable(statement: str) -> bool:
    """A statement EXPLAIN takes (not SET, SHOW, BEGIN ...)."""
    return statement.lstrip().split(None, 1)[0].lower() in EXPLAINED


def plan_of(durable: Durable, statement: str, parameters: Any, analyze: bool) -> Any:
    """EXPLAIN of ``statement`` with its captured parameters, in a transaction rolled back
    (ANALYZE runs it: an UPDATE's rows stay as they were). Text with ``analyze`` (ANALYZE,
    BUFFERS), else the JSON plan."""
    options = "ANALYZE, BUFFERS" if analyze else "FORMAT JSON"
    raw = durable.db.engine.raw_connection()
    try:
        conn = raw.driver_connection
        autocommit = conn.autocommit
        conn.autocommit = False
        try:
            with conn.cursor() as cursor:
                cursor.execute(f"EXPLAIN ({options}) {statement.strip().rstrip(';')}", parameters)
                rows = cursor.fetchall()
        finally:
            conn.rollback()
            conn.autocommit = autocommit
    finally:
        raw.close()
    if analyze:
        return "\n".join(str(r[0]) for r in rows)
    plan = rows[0][0]
    return json.loads(plan) if isinstance(plan, str) else plan


BIG_TABLES = ("durable_runs", "durable_steps", "durable_activity", "durable_keys", "durable_events")


INDEX_SCANS = ("Index Scan", "Index Only Scan", "Bitmap Index Scan")


def table_rows(durable: Durable) -> dict[str, float]:
    """The planner's row count (``reltuples``) of each big table, and of each of its indexes
    that covers most of it (a partial index over the unfinished runs is left out: reading it
    whole reads few rows)."""
    with durable.db.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT c.relname, c.reltuples, i.relname AS index, i.reltuples AS entries FROM pg_class c "
                "LEFT JOIN pg_index x ON x.indrelid = c.oid LEFT JOIN pg_class i ON i.oid = x.indexrelid "
                "WHERE c.relname = ANY(:names)"
            ),
            {"names": list(BIG_TABLES)},
        ).all()
    found: dict[str, float] = {}
    for row in rows:
        found[row.relname] = float(row.reltuples)
        if row.index and float(row.entries) >= float(row.reltuples) / 2:
            found[row.index] = float(row.reltuples)
    return found


# Nodes that read all of their input before giving a row: a Limit above them stops nothing below.
BLOCKING = ("Sort", "Aggregate", "Hash", "SetOp", "WindowAgg", "Materialize")


def _whole_read(
    node: dict[str, Any], rows: dict[str, float] | None, limit: float | None, workers: int
) -> str | None:
    """What the scan ``node`` reads whole (see :func:`seq_scans`), or None."""
    kind = node.get("Node Type")
    share = (workers + 1) if node.get("Parallel Aware") else 1  # a parallel scan's rows are per process
    matched = float(node.get("Plan Rows", 0)) * share
    if kind == "Seq Scan" and node.get("Relation Name") in BIG_TABLES:
        if limit is None or matched <= limit:
            return f"{node['Relation Name']} (filter: {node.get('Filter', 'none')})"
    elif kind in INDEX_SCANS and rows and "Index Cond" not in node:
        index = str(node.get("Index Name"))
        total = rows.get(index, 0.0)
        if total and (matched <= limit if limit is not None else matched >= total / 2):
            return f"{index}, read whole ({kind}; filter: {node.get('Filter', 'none')})"
    return None


def seq_scans(plan: Any, rows: dict[str, float] | None = None) -> list[str]:
    """Big tables a JSON plan reads whole, each with the scan's filter.

    A scan reads its table whole when it is a ``Seq Scan`` of one of ``BIG_TABLES``, or (given
    ``rows``, from :func:`table_rows`) a scan of one of their full indexes with no index
    condition expected to read at least half of the table's rows (a count, a DISTINCT). Under a
    ``Limit`` with nothing between that reads all its input first (a sort, an aggregate), a scan
    stops early: it reads its table whole only when fewer rows than the limit are expected to
    match (a rare filter).
    """
    found: list[str] = []

    def walk(node: Any, limit: float | None, workers: int) -> None:
        """Visit a plan node and its children."""
        if isinstance(node, list):
            for value in node:
                walk(value, limit, workers)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("Node Type")
        limit = float(node.get("Plan Rows", 0)) if kind == "Limit" else None if kind in BLOCKING else limit
        workers = int(node.get("Workers Planned", workers))
        read = _whole_read(node, rows, limit, workers)
        if read:
            found.append(read)
        for key in ("Plan", "Plans"):
            if key in node:
                walk(node[key], limit, workers)

    walk(plan, None, 0)
    return found
