"""Prometheus metrics (the ``[metrics]`` extra): what is worth an alert in production.

``durable.metrics`` holds a registry with two kinds of metrics:

* **a histogram of pool waits**, ``durable_db_pool_wait_seconds``: how long each statement of
  this process waited for a pooled connection (``queue_time``), fed by the pool itself;
* **counters fed by signals** in the process that runs the steps (``run_finished``,
  ``stale_recovered``, ``worker_fenced``, and Celery's ``task_failure`` of a step task that
  raised out of the engine, which means a step's result could not be recorded: a failed ack;
  a step that failed for good also ends its task in ``FAILURE``, and is not counted);
* **gauges read from the database at scrape time**, the same from any process: the ready
  backlog and the age of the oldest ready run per workflow, unfinished runs per status, runs
  finished in the last hour per status, stale locks, draining nodes, disabled schedules and late ones (beat
  down; read from RedBeat too, where it keeps the schedules), runs parked by flow control per
  workflow and what they wait for, concurrency slots in use per workflow, and per fair key of a
  fair limit its slots in use and runs waiting, open batches and their items. A read is reused
  for ``METRICS_CACHE_SECONDS``, so scrapes in quick succession (several Prometheus servers,
  a dashboard) cost the database nothing more.

Serve them with ``durable.metrics.start_http_server(9808)``, with the ``metrics_port`` setting
(each worker serves them while it runs), or with ``celery -A app durable metrics --port
9808`` (database gauges only: the counters live in the workers). Each listens on the
``metrics_addr`` setting, ``127.0.0.1`` unless opened up. Under the prefork pool the steps run
in child processes: set ``PROMETHEUS_MULTIPROC_DIR`` so the children's counters are merged into
what the worker serves.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import signals as celery_signals

from .. import signals
from ..errors import MissingExtra
from ..store import batch_rows, flow_reads, observe_rows, schedule_rows
from ..store.schema import UNFINISHED

if TYPE_CHECKING:
    from ..core.runtime import Runtime

log = logging.getLogger("durable_celery")

RECENT = 3600.0  # the window of durable_runs_finished_recent, seconds
# Pool waits: under a millisecond when the pool is big enough, tens to hundreds when it is not.
POOL_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A scrape this soon after the last database read is served from it: 6 queries per read.
METRICS_CACHE_SECONDS = 5.0


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingExtra("metrics", "durable metrics (prometheus-client)", str(exc)) from exc
    return prometheus_client


@dataclass(frozen=True)
class DatabaseRows:
    """What one read of the database gives the gauges."""

    ready: Sequence[Any]
    unfinished: Sequence[Any]
    recent: Sequence[Any]
    stale: int
    disabled: int
    late: int | None = None  # schedules overdue by more than their period; None: not read
    draining: int = 0  # worker nodes in a graceful shutdown
    # (workflow, what, n): runs parked by flow control ('slot', 'throttle'), slots in use ('in_use')
    flow: Sequence[Any] = ()
    # (workflow, row of flow_reads.fair_use): the fair keys of fair limits defined here
    fair: Sequence[tuple[str, Any]] = ()
    # workflow -> (open batches, items they hold): batch workflows (core/batches.py)
    batches: dict[str, tuple[int, int]] = field(default_factory=dict)


# Fair keys per workflow given a series each, most waiting first (a label per tenant: bounded).
FAIR_KEYS = 50


class DatabaseCollector:
    """Gauges from the database, read at scrape time and reused for ``cache_seconds``."""

    def __init__(self, rt: Runtime, cache_seconds: float = METRICS_CACHE_SECONDS, app: Any = None) -> None:
        self.rt = rt
        self.app = app  # with an app, schedules are read too (durable_schedules_late)
        self.cache_seconds = cache_seconds
        self._lock = threading.Lock()  # concurrent scrapes wait for one read instead of each reading
        self._read_at: float | None = None  # time.monotonic() of the last read, None: read next time
        self._rows: DatabaseRows | None = None  # None: the last read failed
        self._failing = False

    def describe(self) -> list[Any]:
        """No metrics up front, so registering never touches the database."""
        return []

    def invalidate(self) -> None:
        """Make the next scrape read the database, however recent the last read."""
        with self._lock:
            self._read_at = None

    def collect(self) -> Iterator[Any]:
        """The backlog, statuses, stale locks and schedules; one gauge family each."""
        from prometheus_client.core import GaugeMetricFamily

        rows = self._cached_rows()
        up = GaugeMetricFamily("durable_database_up", "1 if the last read of the database succeeded")
        up.add_metric([], 0 if rows is None else 1)
        yield up
        if rows is not None:
            yield from self._families(rows, GaugeMetricFamily)

    def _cached_rows(self) -> DatabaseRows | None:
        with self._lock:
            if self._read_at is None or time.monotonic() - self._read_at >= self.cache_seconds:
                self._rows = self._read_or_none()
                self._read_at = time.monotonic()
            return self._rows

    def _read_or_none(self) -> DatabaseRows | None:
        try:
            rows = self._read()
        except Exception:  # a scrape during a database restart reports it instead of failing
            if not self._failing:  # once per outage, not once per scrape
                log.exception("durable metrics: reading the database failed")
            self._failing = True
            return None
        if self._failing:
            log.info("durable metrics: reading the database works again")
        self._failing = False
        return rows

    def _read(self) -> DatabaseRows:
        rt, db = self.rt, self.rt.db
        with db.engine.connect() as conn:
            schedules = schedule_rows.fetch_schedules(conn)  # the disabled ones and the late ones
            stale, draining = observe_rows.stale_and_draining(db, conn, rt.settings.stale_lock_timeout)
            return DatabaseRows(
                ready=observe_rows.ready_by_workflow(db, conn),
                unfinished=observe_rows.unfinished_by_workflow(conn),
                recent=observe_rows.finished_since(db, conn, RECENT),
                stale=stale,
                disabled=sum(not r.enabled for r in schedules),
                draining=draining,
                late=self._late_schedules(schedules),
                flow=flow_reads.flow_gauges(conn),
                fair=[
                    (name, row)
                    for name in self._fair_workflows()
                    for row in flow_reads.fair_use(conn, name, FAIR_KEYS)
                ],
                batches=batch_rows.open_counts(db, conn) if self._batching() else {},
            )

    def _batching(self) -> bool:
        """Is a workflow defined here a batch workflow (its open batches are read then)?"""
        return any(w.batch is not None for w in self.rt.registry.workflows.values())

    def _fair_workflows(self) -> list[str]:
        """The workflows defined here whose concurrency limit has a fair key."""
        defined = self.rt.registry.workflows.values()
        return sorted(
            w.name or "" for w in defined if w.concurrency is not None and w.concurrency.fair is not None
        )

    def _late_schedules(self, rows: Sequence[Any]) -> int | None:
        """How many schedules are late (beat not firing them); None without an app or Redis."""
        if self.app is None:
            return None
        from redis.exceptions import RedisError

        from ..schedules import late_schedules

        try:
            return len(late_schedules(self.rt, self.app, rows))
        except RedisError as exc:
            log.warning("durable metrics: could not read the schedules: %s", exc)
            return None

    def _families(self, rows: DatabaseRows, gauge: Any) -> list[Any]:
        now = self.rt.db.utcnow()
        backlog = gauge("durable_ready_runs", "Runs due and waiting for a worker", labels=["workflow"])
        oldest = gauge(
            "durable_oldest_ready_run_age_seconds",
            "How long the oldest ready run has been waiting for a worker",
            labels=["workflow"],
        )
        for row in rows.ready:
            backlog.add_metric([row.workflow], row.ready)
            oldest.add_metric([row.workflow], max(0.0, (now - _aware(row.oldest)).total_seconds()))
        runs = gauge("durable_runs", "Unfinished runs per workflow and status", labels=["workflow", "status"])
        counted = {(r.workflow, r.status): r.n for r in rows.unfinished}
        for workflow in sorted({w for w, _ in counted} | set(self.rt.registry.workflows)):
            for status in UNFINISHED:
                runs.add_metric([workflow, status], counted.get((workflow, status), 0))
        finished = gauge(
            "durable_runs_finished_recent",
            f"Runs that finished in the last {int(RECENT)} s, per workflow and final status",
            labels=["workflow", "status"],
        )
        for row in rows.recent:
            finished.add_metric([row.workflow, row.status], row.n)
        stale_gauge = gauge("durable_stale_locks", "Runs locked by a worker that stopped heart-beating")
        stale_gauge.add_metric([], rows.stale)
        schedules = gauge("durable_schedules_disabled", "Cron schedules turned off")
        schedules.add_metric([], rows.disabled)
        draining = gauge("durable_nodes_draining", "Worker nodes in a graceful shutdown (draining)")
        draining.add_metric([], rows.draining)
        families = [backlog, oldest, runs, finished, stale_gauge, schedules, draining]
        families.extend(self._flow_families(rows, gauge))
        if rows.late is not None:
            late = gauge(
                "durable_schedules_late", "Schedules overdue by more than their period: is beat running?"
            )
            late.add_metric([], rows.late)
            families.append(late)
        return families

    def _flow_families(self, rows: DatabaseRows, gauge: Any) -> list[Any]:
        """Runs parked by flow control and slots in use, per workflow: 0 for each workflow
        defined here with such a limit, so an alert sees the series before anything waits."""
        defined = self.rt.registry.workflows.values()
        waiting = gauge(
            "durable_flow_waiting",
            "Runs parked by flow control, per workflow and what they wait for (slot or throttle)",
            labels=["workflow", "wait"],
        )
        parked = {(r.workflow, r.what): int(r.n) for r in rows.flow if r.what != flow_reads.IN_USE}
        for wf in defined:
            for wait, limit in (("slot", wf.concurrency), ("throttle", wf.throttle)):
                if limit is not None:
                    parked.setdefault((wf.name or "", wait), 0)
        for (workflow, wait), n in sorted(parked.items()):
            waiting.add_metric([workflow, wait], n)
        slots = gauge(
            "durable_flow_slots_in_use",
            "Steps holding a concurrency slot (running now), per workflow",
            labels=["workflow"],
        )
        used = {r.workflow: int(r.n) for r in rows.flow if r.what == flow_reads.IN_USE}
        for wf in defined:
            if wf.concurrency is not None:
                used.setdefault(wf.name or "", 0)
        for workflow, n in sorted(used.items()):
            slots.add_metric([workflow], n)
        fair_used = gauge(
            "durable_flow_fair_in_use",
            f"Steps holding a slot of a fair limit, per workflow and fair key (at most {FAIR_KEYS})",
            labels=["workflow", "fair_key"],
        )
        fair_waiting = gauge(
            "durable_flow_fair_waiting",
            f"Runs parked for a slot of a fair limit, per workflow and fair key (at most {FAIR_KEYS})",
            labels=["workflow", "fair_key"],
        )
        for workflow, row in rows.fair:
            fair_used.add_metric([workflow, row.key], int(row.in_use or 0))
            fair_waiting.add_metric([workflow, row.key], int(row.waiting or 0))
        batches = gauge(
            "durable_batches_open", "Open batches gathering starts, per workflow", labels=["workflow"]
        )
        items = gauge(
            "durable_batch_items", "Starts gathered by open batches, per workflow", labels=["workflow"]
        )
        gathering = {wf.name or "": (0, 0) for wf in defined if wf.batch is not None}
        for workflow, (count, held) in sorted({**gathering, **rows.batches}.items()):
            batches.add_metric([workflow], count)
            items.add_metric([workflow], held)
        return [waiting, slots, fair_used, fair_waiting, batches, items]


def _aware(value: Any) -> Any:
    from ..models import aware

    return aware(value)


class DurableMetrics:
    """The Prometheus metrics of one ``Durable``: counters fed by signals, database gauges."""

    def __init__(self, rt: Runtime, app: Any, registry: Any = None) -> None:
        client = _client()
        self.rt = rt
        self.app = app
        self.registry = registry if registry is not None else client.CollectorRegistry()
        counter = client.Counter
        self.runs_finished = counter(
            "durable_runs_finished",
            "Runs that reached a final status, per workflow and status",
            ["workflow", "status"],
            registry=self.registry,
        )
        self.stale_recovered = counter(
            "durable_stale_recovered",
            "Runs taken back from a vanished worker (outcome: handed_back or failed)",
            ["outcome"],
            registry=self.registry,
        )
        self.worker_fenced = counter(
            "durable_worker_fenced",
            "Step results dropped because another worker had taken the run over",
            ["workflow"],
            registry=self.registry,
        )
        self.ack_failed = counter(
            "durable_ack_failed",
            "Step messages whose result could not be recorded (the task raised out of the engine)",
            ["task"],
            registry=self.registry,
        )
        self.steps_finished = counter(
            "durable_steps_finished",
            "Recorded step attempts, per workflow, step and status",
            ["workflow", "step", "status"],
            registry=self.registry,
        )
        self.pool_wait = client.Histogram(
            "durable_db_pool_wait_seconds",
            "How long a statement waited for a connection from this process's pool (queue_time)",
            buckets=POOL_WAIT_BUCKETS,
            registry=self.registry,
        )
        rt.db.pool_wait_observers.append(self.pool_wait.observe)
        self.collector = DatabaseCollector(rt, app=app)
        self.registry.register(self.collector)
        self.server: Any = None  # the HTTP server of start_http_server, once started
        self._connect()

    def _connect(self) -> None:
        sender = self.rt.sender
        signals.run_finished.connect(self._on_run_finished, sender=sender)
        signals.step_finished.connect(self._on_step_finished, sender=sender)
        signals.stale_recovered.connect(self._on_stale_recovered, sender=sender)
        signals.worker_fenced.connect(self._on_worker_fenced, sender=sender)
        celery_signals.task_failure.connect(self._on_task_failure)

    def _on_run_finished(self, sender: Any = None, workflow: str = "", status: str = "", **_: Any) -> None:
        self.runs_finished.labels(workflow, status).inc()

    def _on_step_finished(
        self, sender: Any = None, workflow: str = "", step: str = "", status: str = "", **_: Any
    ) -> None:
        self.steps_finished.labels(workflow, step, status).inc()

    def _on_stale_recovered(
        self, sender: Any = None, run_ids: Any = (), failed_ids: Any = (), **_: Any
    ) -> None:
        if run_ids:
            self.stale_recovered.labels("handed_back").inc(len(run_ids))
        if failed_ids:
            self.stale_recovered.labels("failed").inc(len(failed_ids))

    def _on_worker_fenced(self, sender: Any = None, workflow: str = "", **_: Any) -> None:
        self.worker_fenced.labels(workflow).inc()

    def _on_task_failure(self, sender: Any = None, exception: Any = None, **_: Any) -> None:
        from celery.exceptions import WorkerLostError

        from ..worker.task_states import step_failed

        name = getattr(sender, "name", "") or ""
        ours = name.startswith("durable.") and getattr(sender, "app", None) is self.app
        # A failed step is recorded, and so is a lost pool process (lost.py): neither is a
        # message whose result could not be recorded.
        if ours and not step_failed(sender) and not isinstance(exception, WorkerLostError):
            self.ack_failed.labels(name).inc()

    def register(self, registry: Any) -> None:
        """Also expose these metrics in another registry (e.g. ``prometheus_client.REGISTRY``)."""
        for collector in (
            self.runs_finished,
            self.steps_finished,
            self.stale_recovered,
            self.worker_fenced,
            self.ack_failed,
            self.pool_wait,
            self.collector,
        ):
            registry.register(collector)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format, as a scrape would get it."""
        return bytes(_client().generate_latest(self.registry))

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's current value (e.g. ``value("durable_ready_runs", {"workflow": "x"})``),
        the database gauges read afresh."""
        self.collector.invalidate()
        found = self.registry.get_sample_value(name, labels or {})
        return None if found is None else float(found)

    def serving_registry(self) -> Any:
        """What an HTTP endpoint serves: this registry, or the merged counters of every process
        (``PROMETHEUS_MULTIPROC_DIR``) with this process's database gauges."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return self.registry
        client = _client()
        from prometheus_client import multiprocess

        merged = client.CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        merged.register(self.collector)
        return merged

    def start_http_server(self, port: int, addr: str | None = None) -> Any:
        """Serve ``/metrics`` on ``addr:port`` (``addr`` defaults to the ``metrics_addr`` setting,
        ``127.0.0.1``) from a daemon thread; returns the HTTP server."""
        addr = self.rt.settings.metrics_addr if addr is None else addr
        started = _client().start_http_server(port, addr=addr, registry=self.serving_registry())
        server = self.server = started[0] if isinstance(started, tuple) else started
        log.info("durable: metrics on %s", metrics_url(addr, getattr(server, "server_port", port)))
        return server


def metrics_url(addr: str, port: int) -> str:
    """The /metrics URL of a server listening on ``addr:port`` (an IPv6 address in brackets)."""
    host = f"[{addr}]" if ":" in addr else addr
    return f"http://{host}:{port}/metrics"


class Endpoint:
    """The /metrics endpoint a worker serves while it runs."""

    def __init__(self, metrics: DurableMetrics, port: int) -> None:
        self.metrics = metrics
        self.port = port

    def start(self) -> None:
        """Start serving on the ``metrics_addr`` setting."""
        self.metrics.start_http_server(self.port)

    def stop(self) -> None:
        """Stop serving."""
        metrics = self.metrics
        server, metrics.server = metrics.server, None
        if server is not None:
            server.shutdown()


def serve_from_worker(app: Any, metrics: DurableMetrics, port: int) -> None:
    """Serve ``metrics`` from each worker of ``app`` (a worker bootstep)."""
    from celery import bootsteps

    class DurableMetricsEndpoint(bootsteps.StartStopStep):
        """Durable's /metrics endpoint, started and stopped with the worker."""

        def create(self, worker: Any) -> Endpoint:
            return Endpoint(metrics, port)

    app.steps["worker"].add(DurableMetricsEndpoint)
