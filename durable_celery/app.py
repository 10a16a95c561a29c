"""``Durable``: binds durable workflows to one Celery app (settings, tasks, upkeep, the API)."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any

from celery import Celery

from . import paging
from .capabilities import Capability, of_backend
from .core import answers, atomic, control, forks
from .core import bulk as bulk_actions
from .core.bulk import BulkReport
from .core.engine import Engine
from .core.runs import backoff
from .core.runtime import Outbox, Runtime
from .core.starts import Starter
from .definition import Registry, SendEvent, Step, Workflow, share, workflow_options
from .errors import InvalidArgument, InvalidDefinition, RunNotFound
from .instrument.hooks import Instrumentation
from .models import Run, StepRecord
from .observe import activity as observe
from .observe.activity import Activity, KeyEntry, PendingInput, Stats
from .schedules import beat
from .schedules import fires as schedule_fires
from .schedules.methods import ScheduleMethods
from .settings import Settings
from .store import migrate as migrations
from .store import queries, replica_rows, run_filters
from .store.db import Database
from .store.schema import FINISHED, UNFINISHED
from .worker import broker_reconnect, transport, upkeep
from .worker.dispatch import CeleryOutbox
from .worker.publisher import Publisher
from .worker.tasks import StepTasks, answer_unknown_steps

if TYPE_CHECKING:
    from .observe.doctor import Finding
    from .observe.metrics import DurableMetrics

log = logging.getLogger("durable_celery")

STATUSES = UNFINISHED + FINISHED


class Durable(ScheduleMethods):
    """Durable, keyed workflows for one Celery app; see the README for a tour."""

    def __init__(
        self,
        app: Celery,
        database_url: str | None = None,
        *,
        capabilities: Capability = Capability.ALL,
        outbox: Outbox | None = None,
        database: Database | None = None,
        read_database: Database | None = None,
        **settings: Any,
    ) -> None:
        # Build the parts once: the core gets them as a Runtime, never this object. A part may
        # be given: the outbox (testing.RecordingOutbox), the database (contrib.django's).
        self.app = app
        self.settings = Settings.build(app, database_url, settings)
        self.db = database or Database(
            self.settings.database_url or "",
            pool_size=self.settings.pool_size,
            prepared_statements=not self.settings.pgbouncer,
        )
        # What operators read (dashboard, admin, reports, metrics): a replica when one is given.
        self.reads: Database = read_database or self.db.replica(self.settings.read_database_url)
        if not isinstance(capabilities, Capability):
            raise InvalidDefinition(f"capabilities must be a Capability, not {capabilities!r}")
        self.registry = Registry()
        # Where step messages go: Celery's broker, or what a test gives (testing.RecordingOutbox).
        self.outbox: Outbox = outbox or CeleryOutbox(app, self.db, self.registry, self.settings)
        self.runtime = Runtime(
            db=self.db,
            settings=self.settings,
            registry=self.registry,
            outbox=self.outbox,
            instrumentation=Instrumentation(self.db, self.settings),
            capabilities=capabilities & of_backend(postgres=self.db.is_postgres, memory=bool(self.db.memory)),
            default_queue=lambda: str(app.conf.task_default_queue),
            sender=self,
        )
        # The same parts reading the replica: for the operators' reads only, never a write.
        self.read_runtime = self.runtime if self.reads is self.db else replace(self.runtime, db=self.reads)
        self.engine = Engine(self.runtime)
        self.tasks = StepTasks(app, self.engine)
        self.starter = Starter(self.runtime, self.engine)
        self.registry.on_step = self.tasks.add
        self.registry.check_step = partial(atomic.check_target, self.db)
        self.registry.starter = self.starter
        self.stats = Stats(self.runtime)
        self.answers = answers.Answers(self.db)  # callers waiting for runs to end (result)
        # Then bind to Celery: broker, beat, worker bootsteps, signals and tasks.
        self._use_embedded_broker_if_unset()
        beat.default_loop_interval(app)  # run-time schedules are seen within seconds
        self._setup_watching()
        app._durable = self  # type: ignore[attr-defined]
        app._durable_registry = self.registry  # type: ignore[attr-defined]  # Workflow.bound()
        app._durable_runtime = self.runtime  # type: ignore[attr-defined]  # DurableScheduler
        broker_reconnect.install(app)  # workers outlive a broker restart (Celery 5.7.0)
        upkeep.install(self.runtime, self.engine, app)
        self._unknown_steps = answer_unknown_steps(self.runtime, app)
        schedule_fires.install(self.runtime, app)
        self.registry.adopt_shared()

    def __repr__(self) -> str:
        return f"<Durable app={self.app.main!r} db={self.db.masked_url}>"  # creates no engine

    @property
    def capabilities(self) -> Capability:
        """What this Durable supports: its backend's capabilities (capabilities.py), less any
        it was told not to claim."""
        return self.runtime.capabilities

    def require(
        self, needed: Capability, operation: str, what: str, workflow: str | Workflow | None = None
    ) -> None:
        """Raise Unsupported (naming ``needed`` and the workflow) unless this Durable has it."""
        name = workflow.name if isinstance(workflow, Workflow) else workflow
        self.runtime.require(needed, operation, what, name)

    @property
    def workflows(self) -> dict[str, Workflow]:
        """The workflows defined here, by name."""
        return self.registry.workflows

    @property
    def publisher(self) -> Publisher:
        """This Durable's background publisher (of its Celery outbox)."""
        if not isinstance(self.outbox, CeleryOutbox):
            raise AttributeError("this Durable's outbox sends nothing to Celery: it has no publisher")
        return self.outbox.publisher

    @property
    def inline(self) -> bool:
        """Whether steps run in the calling thread (``testing.Fake``): nothing is published."""
        return self.outbox.inline

    @inline.setter
    def inline(self, value: bool) -> None:
        self.outbox.inline = value

    @property
    def on_new_task(self) -> list[Callable[[], None]]:
        """Called after a step's task is registered (a worker running in this process learns it)."""
        return self.tasks.on_new_task

    @property
    def eager(self) -> bool:
        """Whether ``start()`` runs the run's steps in the calling thread (``task_always_eager``)."""
        return self.outbox.eager

    def _use_embedded_broker_if_unset(self) -> None:
        # Never let Celery fall back to amqp://localhost quietly: with no broker chosen, use the
        # serverless filesystem transport next to the SQLite file (one machine, many processes;
        # a message lost with a crashed worker is sent again by the relay). The in-memory store
        # is one process only, and so is Celery's memory:// broker.
        if self.app.conf.broker_url or os.environ.get("CELERY_BROKER_URL"):
            return
        if self.db.memory:
            self.app.conf.broker_url = "memory://localhost/"
            self.app.conf.broker_transport_options = {"polling_interval": 0.05}
            return
        folder = os.path.abspath(os.path.join(self.settings.home, "broker"))
        os.makedirs(folder, exist_ok=True)
        self.app.conf.broker_url = f"{transport.SCHEME}://"
        self.app.conf.broker_transport_options = {
            "data_folder_in": folder,
            "data_folder_out": folder,
            # Broadcasts (remote control, Flower) keep their exchange tables here, not in ./control.
            "control_folder": os.path.join(folder, "control"),
            "polling_interval": 0.1,
        }

    # -- definitions ------------------------------------------------------------------------

    def workflow(self, name: str | Callable[..., Any] | None = None, **options: Any) -> Workflow:
        """Define a workflow; as a decorator on a function it is the first step and the name."""
        return self.registry.define(name, **options)

    def adopt(self, workflow: Workflow) -> None:
        """Make sure a shared workflow is known here (used by ``Workflow.start``)."""
        self.registry.adopt(workflow)

    def run_message(self, workflow_name: str, step_index: int, run_id: str, compensate: bool = False) -> str:
        """Handle a step (or compensation) message as a worker received it."""
        workflow = self.workflows[workflow_name]
        return self.engine.execute(workflow, workflow.steps[step_index], run_id, compensate=compensate)

    # -- starting ---------------------------------------------------------------------------

    def start(
        self,
        workflow: str | Workflow,
        input: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        on_duplicate: str | SendEvent | None = None,
        connection: Any = None,
        tags: Mapping[str, str] | None = None,
        priority: int | None = None,
    ) -> str:
        """Start a run and return its id, or the id the key's holder answers with.

        The first step is published once the transaction commits; with ``connection`` the
        run is written in the caller's open transaction and goes out after their commit.
        ``tags`` (str to str) are kept with the run, its children and its reruns and forks.
        ``priority`` (the workflow's when None): among runs waiting for a flow limit, higher first.
        """
        return self.starter.start(
            workflow,
            input,
            key=key,
            on_duplicate=on_duplicate,
            connection=connection,
            tags=tags,
            priority=priority,
        )

    def result(self, run_id: str, timeout: float | None = None) -> Any:
        """Wait for run ``run_id`` to end and return its output; RunFailed, RunCancelled, or
        ResultTimeout when ``timeout`` seconds pass first (the run goes on)."""
        return answers.result(self.db, self.answers, run_id, timeout)

    def execute(
        self,
        workflow: str | Workflow,
        input: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        on_duplicate: str | SendEvent | None = None,
        timeout: float | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> Any:
        """``start``, then ``result``: a held key's holder answers with its own output."""
        answers.refuse_inside_step("execute")
        answers.check_timeout(timeout)
        run_id = self.start(workflow, input, key=key, on_duplicate=on_duplicate, tags=tags)
        return self.result(run_id, timeout)

    async def astart(
        self,
        workflow: str | Workflow,
        input: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        on_duplicate: str | SendEvent | None = None,
        connection: Any = None,
        tags: Mapping[str, str] | None = None,
        priority: int | None = None,
    ) -> str:
        """``start`` without blocking the event loop; ``connection``: an AsyncConnection or
        AsyncSession whose open transaction the start joins."""
        start = partial(
            self.start, workflow, input, key=key, on_duplicate=on_duplicate, tags=tags, priority=priority
        )
        if connection is None:
            return await asyncio.to_thread(start)
        return await connection.run_sync(lambda sync: start(connection=sync))  # type: ignore[no-any-return]

    async def aget_run(self, run_id: str) -> Run:
        """``get_run`` without blocking the event loop."""
        return await asyncio.to_thread(self.get_run, run_id)

    async def aresult(self, run_id: str, timeout: float | None = None) -> Any:
        """``result`` without blocking the event loop."""
        return await answers.result_async(self.db, self.answers, run_id, timeout)

    async def aexecute(
        self,
        workflow: str | Workflow,
        input: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        on_duplicate: str | SendEvent | None = None,
        timeout: float | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> Any:
        """``execute`` without blocking the event loop."""
        answers.refuse_inside_step("aexecute")
        answers.check_timeout(timeout)
        run_id = await self.astart(workflow, input, key=key, on_duplicate=on_duplicate, tags=tags)
        return await self.aresult(run_id, timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message this process queued to publish is sent (or flagged for the
        relay); False if ``timeout`` seconds passed first. Exiting the process does it too."""
        return self.outbox.flush(timeout)

    def backoff(self, step: Step, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1`` of ``step``."""
        return backoff(self.settings, step, attempt)

    # -- reading ----------------------------------------------------------------------------

    def get_run(self, run_id: str) -> Run:
        """One run by id; RunNotFound if there is none."""
        if not isinstance(run_id, str):
            raise RunNotFound(run_id)
        with self.db.engine.connect() as conn:
            row = queries.fetch_run(conn, run_id)
        if row is None:
            raise RunNotFound(run_id)
        return Run.from_row(row)

    def list_runs(
        self,
        workflow: str | None = None,
        key: str | None = None,
        status: str | None = None,
        limit: int = 100,
        *,
        tags: Mapping[str, str] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        error_type: str | None = None,
        key_prefix: str | None = None,
        after: str | None = None,
    ) -> list[Run]:
        """Runs matching the filters, newest first: ``tags`` (every one), created in
        [``since``, ``until``), failed with ``error_type``, keys starting with ``key_prefix``;
        ``after``: the next page, after the run with that id (the last one of a page)."""
        where = bulk_actions.run_filter(workflow, status, key, key_prefix, tags, since, until, error_type)
        limit, after = paging.check_limit(limit), paging.check_after(after)
        with self.db.engine.connect() as conn:
            found = run_filters.conditions_at_volume(self.db, conn, where)
            rows = queries.fetch_runs(conn, *found, after=after, limit=limit)
        return [Run.from_row(r) for r in rows]

    def list_steps(
        self, run_id: str, limit: int | None = None, *, after: int | None = None
    ) -> list[StepRecord]:
        """A run's step attempts in order; ``after``: past the step with that id. RunNotFound if no run."""
        return observe.list_steps(self.runtime, run_id, limit, after=after)

    # -- control ----------------------------------------------------------------------------

    def cancel(self, run_id: str, *, by: str | None = None, origin: str | None = None) -> bool:
        """Cancel an unfinished run; False if it had already finished. RunNotFound if none.
        Who (``by``) and from where (``origin``) go on its ``cancelled`` activity entry."""
        return control.cancel(self.runtime, run_id, by, origin)

    def retry(self, run_id: str, *, by: str | None = None, origin: str | None = None) -> str:
        """Resume a failed run from its failed step; KeyTaken if a newer run keeps its key,
        InvalidStart if its input no longer fits the workflow's steps. Who (``by``) and from
        where (``origin``) go on its ``retried`` activity entry."""
        run = self.get_run(run_id)
        workflow = self.workflows.get(run.workflow)
        if workflow is not None:
            workflow.check_fits(run.input)  # the steps changed since it started: retrying cannot help
        return control.retry(self.runtime, run_id, by, origin)

    def rerun(self, run_id: str) -> str:
        """Start a fresh copy of a finished run with its input and key; KeyTaken if held."""
        return control.rerun(self.runtime, run_id)

    def fork(
        self,
        run_id: str,
        from_step: str | int,
        *,
        input: Mapping[str, Any] | None = None,
        context: Mapping[str, Any] | None = None,
        key: Any = forks.KEEP,
    ) -> str:
        """A new run of finished run ``run_id`` that begins at ``from_step`` (a name or index) on
        today's definition, with the context that step found (or ``context``); its id. It takes
        the original's key only if free (KeyTaken otherwise); ``key=None`` runs it unkeyed."""
        return forks.fork(self.runtime, run_id, from_step, input=input, context=context, key=key)

    def bulk(
        self,
        action: str,
        *,
        dry_run: bool = False,
        from_step: str | int | None = None,
        by: str | None = None,
        progress: Callable[[str], None] | None = None,
        **filters: Any,
    ) -> BulkReport:
        """``retry``, ``cancel``, ``rerun`` or ``fork`` (``from_step``) every run the filters of
        ``list_runs`` name, in pages, each run in its own transaction; the counts (``dry_run``:
        what it would do). Run again, it skips what it did."""
        where = bulk_actions.run_filter(**filters)
        return bulk_actions.bulk(
            self.runtime, action, where, dry_run=dry_run, from_step=from_step, by=by, progress=progress
        )

    def release_key(self, run_id: str, by: str | None = None) -> None:
        """Free a finished run's key (NotFinished, NoKey otherwise); ``by`` is recorded."""
        control.release_key(self.runtime, run_id, by)

    def drain(self) -> None:
        """Shut down the worker this code runs in, gracefully: stop taking work, give running
        steps ``shutdown_grace_period`` seconds, then hand the rest back. InvalidArgument in a
        process that runs no worker (send the worker SIGTERM, or ``celery control shutdown``)."""
        from celery.worker import state

        if not self.engine.worker_pid:
            raise InvalidArgument(
                "drain() shuts down the worker it runs in, and this process runs none: send the "
                "worker SIGTERM, or run `celery -A <app> control shutdown --destination <node>`"
            )
        self.engine.drain(self.settings.shutdown_grace_period)
        main = self.engine.worker_pid
        if main and main != os.getpid():  # a prefork pool process: tell its worker, the parent
            os.kill(main, signal.SIGTERM)  # Celery's warm shutdown
        else:
            state.should_stop = 0  # the worker's loop starts its warm shutdown

    def list_children(self, run_id: str, limit: int = 1000) -> list[Run]:
        """The child workflows and parallel branches a run started, oldest first."""
        with self.db.engine.connect() as conn:
            rows = queries.fetch_runs(conn, parent_id=run_id, limit=limit)
        return [Run.from_row(row) for row in reversed(rows)]

    def send_event(self, run_id: str, name: str, payload: Any = None, buffer: bool = False) -> bool:
        """Deliver event ``name`` to a run waiting for it, or keep it with ``buffer=True``."""
        self.require(Capability.EVENTS, "send_event", "events", self._workflow_of(run_id))
        return control.send_event(self.runtime, run_id, name, payload, buffer)

    def provide_input(self, run_id: str, name: str, value: Any = None) -> bool:
        """Give a run the input ``name`` it waits for (kept if it is not waiting yet)."""
        self.require(Capability.WAITS, "provide_input", "waiting for input", self._workflow_of(run_id))
        return control.provide_input(self.runtime, run_id, name, value)

    def _workflow_of(self, run_id: str) -> str | None:
        """The workflow of a run, for an Unsupported message (only read when it is raised)."""
        if Capability.EVENTS | Capability.WAITS in self.capabilities:
            return None
        try:
            return self.get_run(run_id).workflow
        except RunNotFound:
            return None

    def list_pending_inputs(self, workflow: str | None = None, limit: int = 100) -> list[PendingInput]:
        """Runs waiting for an input, oldest first."""
        return observe.list_pending_inputs(self.runtime, workflow, limit)

    # -- watching ---------------------------------------------------------------------------

    def activity(
        self,
        kinds: Any = None,
        run_id: str | None = None,
        workflow: str | None = None,
        limit: int = 100,
        *,
        after: int | None = None,
    ) -> list[Activity]:
        """Activity entries (key decisions and more), newest first; ``after``: the next page,
        past the entry with that id (the last one of a page)."""
        return observe.list_activity(self.runtime, kinds, run_id, workflow, limit, after=after)

    def list_keys(
        self,
        workflow: str | None = None,
        limit: int = 1000,
        *,
        prefix: str | None = None,
        after: str | None = None,
    ) -> list[KeyEntry]:
        """Held keys, newest taken first, with their holder, whether each blocks a new start, runs
        per key and re-adds in the last day; ``prefix``: keys starting with it; ``after``: a ``cursor``."""
        return observe.list_keys(self.runtime, workflow, limit, prefix=prefix, after=after)

    @cached_property
    def reader(self) -> Durable:
        """This Durable reading its replica (``read_database_url``), for operators' reads only
        (the dashboard, reports, metrics); itself without a replica."""
        if self.reads is self.db:
            return self
        view = copy.copy(self)
        view.db, view.runtime, view.stats = self.reads, self.read_runtime, Stats(self.read_runtime)
        view.__dict__.update(reader=view, _reading=True)  # a reader's db is the replica
        return view

    def replication_lag(self) -> float | None:
        """Seconds the read replica (``read_database_url``) is behind the primary; None without one."""
        if self.reads is self.db and not getattr(self, "_reading", False):  # no replica
            return None
        with self.reads.engine.connect() as conn:
            return replica_rows.replication_lag(conn)

    def count_runs(self) -> dict[tuple[str, str], int]:
        """How many runs each workflow has in each status, exactly: it reads every run (for
        an overview of a big table, ``status_summary()`` counts each status up to 10,000)."""
        with self.db.engine.connect() as conn:
            return queries.count_runs_by_status(conn)

    # -- operations -------------------------------------------------------------------------

    def migrate(self, progress: Callable[[str], None] | None = None) -> list[str]:
        """Bring the database schema up to date; returns the revisions applied."""
        return migrations.upgrade(self.db, progress)

    def pending_migrations(self) -> list[str]:
        """Revisions the database still lacks (empty when up to date)."""
        return migrations.pending_revisions(self.db)

    # == watching: metrics, doctor and status (metrics.py, doctor.py) ==========================

    def _setup_watching(self) -> None:
        self._metrics: DurableMetrics | None = None
        port = self.settings.metrics_port
        if port is not None:  # checked by Settings.build
            from .observe.metrics import serve_from_worker

            self.metrics  # noqa: B018 - counters must exist before the first step is counted
            serve_from_worker(self.app, self.metrics, port)

    @property
    def metrics(self) -> DurableMetrics:
        """Prometheus metrics (``DurableMetrics``; needs the ``[metrics]`` extra)."""
        if self._metrics is None:
            from .observe.metrics import DurableMetrics

            self._metrics = DurableMetrics(self.read_runtime, self.app)  # a replica's, when given
        return self._metrics

    def doctor(self, fix: bool = False) -> list[Finding]:
        """Stuck state as ``Finding`` records; ``fix=True`` repairs what is safe and marks it."""
        from .observe.doctor import doctor

        return doctor(self.runtime, self.app, fix=fix)

    def status_summary(self) -> dict[str, Any]:
        """Runs per status, ready backlog, oldest ready run, stale locks, nodes, schedules."""
        from .observe.doctor import summary

        return summary(self.runtime)

    # -- running in production: retention, queues, nodes (prune.py, queues.py, nodes.py) ---

    def prune(self, progress: Callable[[str], None] | None = None) -> dict[str, int]:
        """Run the configured ``prune=`` rules now; returns runs deleted per rule."""
        from .core import prune

        return prune.prune(self.db, self.settings.prune, progress)

    def cleanup(
        self,
        older_than: Any,
        statuses: Any = None,
        *,
        dry_run: bool = False,
        progress: Callable[[str], None] | None = None,
    ) -> dict[str, int]:
        """Delete finished runs older than ``older_than`` (e.g. ``"30d"``); counts runs, steps, events."""
        from .core import prune

        return prune.cleanup(self.db, older_than, statuses, dry_run=dry_run, progress=progress)

    def pause_queue(self, name: str) -> None:
        """Stop every worker from running steps of queue ``name`` until it is resumed."""
        from .core import queues

        queues.pause_queue(self.db, name)

    def resume_queue(self, name: str) -> int:
        """Let workers run queue ``name`` again; returns how many ready runs were sent again."""
        from .core import queues

        return queues.resume_queue(self.db, name)

    def list_nodes(self) -> list[dict[str, Any]]:
        """Worker nodes seen in the last day: name, queues, pid, draining, started_at, seen_at."""
        from .store import node_rows

        with self.db.engine.connect() as conn:
            return [dict(r._mapping) for r in node_rows.list_nodes(conn)]


def durable_workflow(name: str | Callable[..., Any] | None = None, **options: Any) -> Any:
    """Define a workflow bound to whichever app's ``Durable`` is current, like ``shared_task``."""

    def define(fn: Callable[..., Any]) -> Workflow:
        workflow = Workflow(name=name if isinstance(name, str) else None, **workflow_options(dict(options)))
        workflow.shared = True
        workflow(fn)
        share(workflow)
        return workflow

    if callable(name):
        fn, name = name, None
        return define(fn)
    return define
