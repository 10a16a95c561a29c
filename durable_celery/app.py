"""``Durable``: binds durable workflows to one Celery app (settings, tasks, upkeep, the API)."""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery import Celery

from . import beat, continuation, control, observe, schedule_fires, schedules, tracing, transport
from .capabilities import Capability, of_backend, require
from .definition import SendEvent, Step, Workflow, check_input, check_on_duplicate
from .engine import Engine
from .errors import (
    InvalidArgument,
    InvalidDefinition,
    NotConfigured,
    RunNotFound,
    UnknownWorkflow,
)
from .keys import start_run
from .models import Run, StepRecord
from .observe import Activity, KeyEntry, PendingInput, Stats
from .publisher import Message, Publisher
from .queues import queue_of
from .schedules import UNSET, Schedule
from .settings import Settings
from .store import migrate as migrations
from .store import queries
from .store.db import Clock, Database
from .store.schema import FINISHED, UNFINISHED

if TYPE_CHECKING:
    from .doctor import Finding
    from .metrics import DurableMetrics

log = logging.getLogger("durable_celery")

STATUSES = UNFINISHED + FINISHED


_live: weakref.WeakSet[Durable] = weakref.WeakSet()
_shared: list[Workflow] = []


def new_run_id() -> str:
    """A new run id: a time-ordered UUID (RFC 9562 version 7) as text.

    Ids that grow with time put new runs at the right edge of the primary key's index, where its
    pages stay cached: starts and claims of recent runs do not slow down as history grows.
    """
    make = getattr(uuid, "uuid7", None)  # Python 3.14+
    if make is not None:
        return str(make())
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits; 74 are used
    value = (millis & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | (rand >> 68) << 64 | 0b10 << 62
    value |= rand & 0x3FFF_FFFF_FFFF_FFFF
    return str(uuid.UUID(int=value))


class Durable:
    """Durable, keyed workflows for one Celery app; see the README for a tour."""

    def __init__(
        self,
        app: Celery,
        database_url: str | None = None,
        *,
        capabilities: Capability = Capability.ALL,
        **settings: Any,
    ) -> None:
        self.app = app
        self.settings = Settings.build(app, database_url, settings)
        self.db = Database(
            self.settings.database_url or "",
            pool_size=self.settings.pool_size,
            prepared_statements=not self.settings.pgbouncer,
        )
        if not isinstance(capabilities, Capability):
            raise InvalidDefinition(f"capabilities must be a Capability, not {capabilities!r}")
        self._claimed = capabilities
        # Steps run in the calling thread (testing.Fake, task_always_eager): nothing is published.
        self.inline = False
        # Called after a step's task is registered (testing.worker: a worker already running in
        # this process learns tasks defined after it started).
        self.on_new_task: list[Callable[[], None]] = []
        self.workflows: dict[str, Workflow] = {}
        self.engine = Engine(self)
        self.publisher = Publisher(
            app, self._flag_unsent, self.settings.publish_retries, self.settings.publish_linger
        )
        self.stats = Stats(self)
        if self.settings.stale_lock_timeout < 3 * self.settings.heartbeat_interval:
            log.warning(
                "durable: stale_lock_timeout (%ss) is under 3 x heartbeat_interval (%ss): "
                "a slow heartbeat may hand a live step to another worker",
                self.settings.stale_lock_timeout,
                self.settings.heartbeat_interval,
            )
        self._use_embedded_broker_if_unset()
        beat.default_loop_interval(app)  # run-time schedules are seen within seconds
        self._setup_watching()
        app._durable = self  # type: ignore[attr-defined]
        from . import broker_reconnect, rollout, upkeep

        broker_reconnect.install(app)  # workers outlive a broker restart (Celery 5.7.0)
        upkeep.install(self)
        self._unknown_steps = rollout.install(self)
        schedule_fires.install(self)
        _live.add(self)
        for workflow in _shared:
            if workflow.name is not None:
                self._register_workflow(workflow)

    def __repr__(self) -> str:
        return f"<Durable app={self.app.main!r} db={self.db.masked_url}>"  # creates no engine

    @property
    def capabilities(self) -> Capability:
        """What this Durable supports: its backend's capabilities (capabilities.py), less any
        it was told not to claim."""
        return self._claimed & of_backend(postgres=self.db.is_postgres, memory=bool(self.db.memory))

    def require(
        self, needed: Capability, operation: str, what: str, workflow: str | Workflow | None = None
    ) -> None:
        """Raise Unsupported (naming ``needed`` and the workflow) unless this Durable has it."""
        name = workflow.name if isinstance(workflow, Workflow) else workflow
        require(self.capabilities, needed, operation, what, name)

    @property
    def eager(self) -> bool:
        """Whether ``start()`` runs the run's steps in the calling thread (``task_always_eager``)."""
        return bool(self.app.conf.task_always_eager)

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
        if callable(name):
            return Workflow(durable=self)(name)
        workflow = Workflow(name=name, durable=self, **options)
        if name is not None:
            self._register_workflow(workflow)
        return workflow

    def _register_workflow(self, workflow: Workflow) -> None:
        assert workflow.name is not None
        existing = self.workflows.get(workflow.name)
        if existing is not None and existing is not workflow:
            raise InvalidDefinition(f"a workflow named {workflow.name!r} is already defined")
        self.workflows[workflow.name] = workflow
        for step in workflow.steps:
            self._register_step(workflow, step)
        for branch in workflow.branches:
            if branch.name not in self.workflows:
                branch.durable = workflow.durable
                self._register_workflow(branch)

    def _register_step(self, workflow: Workflow, step: Step) -> None:
        from . import task_states

        durable = self
        workflow_name, index = workflow.name, step.index

        def run_step(
            task: Any, run_id: str, step: int = index, attempt: int = 1, phase: str = "step"
        ) -> task_states.StepSummary:
            # The task's Celery state tells what the attempt came to (task_states.py).
            compensate = phase == "compensate"
            wf = durable.workflows[workflow_name or ""]
            queue = (task.request.delivery_info or {}).get("routing_key")
            events = task_states.InlineEvents(task) if durable.engine.task_events.value else None
            result = continuation.run_message(
                durable.engine, wf, wf.steps[index], run_id, compensate, queue, events
            )
            return task_states.task_result(
                result, task.request, run_id, wf, wf.steps[index], compensate, durable.backoff
            )

        run_step.__name__ = step.name
        run_step.__doc__ = f"Durable step {step.name!r} of workflow {workflow_name!r}."
        self.app.task(
            name=step.task_name,
            bind=True,
            shared=False,
            acks_late=True,
            acks_on_failure_or_timeout=True,  # a failed step is recorded: never leave its message
            ignore_result=True,
            serializer="json",
            typing=False,
            # Records a pool process that dies mid-step, and announces ignored messages.
            Request="durable_celery.task_states:StateRequest",
            durable_workflow=workflow_name,
            durable_step=index,
        )(run_step)
        for hook in list(self.on_new_task):
            hook()

    def adopt(self, workflow: Workflow) -> None:
        """Make sure a shared workflow is known here (used by ``Workflow.start``)."""
        if workflow.name not in self.workflows:
            self._register_workflow(workflow)

    def run_message(self, workflow_name: str, step_index: int, run_id: str, compensate: bool = False) -> str:
        """Handle a step (or compensation) message as a worker received it."""
        workflow = self.workflows[workflow_name]
        return self.engine.execute(workflow, workflow.steps[step_index], run_id, compensate=compensate)

    # -- starting and publishing ------------------------------------------------------------

    def _resolve(self, workflow: str | Workflow) -> Workflow:
        if isinstance(workflow, Workflow):
            if workflow.name is None:
                raise UnknownWorkflow("this workflow has no name (decorate a function or pass name=)")
            known = self.workflows.get(workflow.name)
            if known is None and workflow.durable is None:
                self._register_workflow(workflow)
            elif known is not workflow:
                raise UnknownWorkflow(f"workflow {workflow.name!r} belongs to another Durable")
            resolved = workflow
        elif isinstance(workflow, str) and workflow in self.workflows:
            resolved = self.workflows[workflow]
        else:
            raise UnknownWorkflow(f"no workflow named {workflow!r} is defined")
        if not resolved.steps:
            raise UnknownWorkflow(f"workflow {resolved.name!r} has no steps")
        return resolved

    def start(
        self,
        workflow: str | Workflow,
        input: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        on_duplicate: str | SendEvent | None = None,
        connection: Any = None,
    ) -> str:
        """Start a run and return its id, or the id the key's holder answers with.

        The first step is published once the transaction commits; with ``connection`` the
        run is written in the caller's open transaction and goes out after their commit.
        """
        wf = self._resolve(workflow)
        data = check_input(input, self.settings.max_input_bytes)
        run_key = wf.derive_key(data, key)
        policy = wf.on_duplicate if on_duplicate is None else check_on_duplicate(on_duplicate, wf)
        self._check_start(wf, run_key, policy, connection)
        run = self._new_run(wf, data, run_key)
        tracing.stamp_run(self, wf, run)  # the run's trace (tracing.py)
        if connection is not None:
            from .transactions import start_in_callers_transaction

            return start_in_callers_transaction(self, connection, wf, run, policy)
        decision = start_run(self, wf, run, policy)
        decision.after_commit(self)
        if self.eager and not self.inline:
            from .inline import run_eagerly

            run_eagerly(self, decision.run_id)
        return decision.run_id

    def _check_start(self, wf: Workflow, key: str | None, policy: Any, connection: Any) -> None:
        """Unsupported when the start needs a capability this Durable lacks."""
        if key is not None:
            self.require(Capability.IDEMPOTENCY_KEY, "start", "key", wf)
            if isinstance(policy, SendEvent):
                self.require(Capability.EVENTS, "start", "on_duplicate=SendEvent", wf)
        if connection is not None:
            self.require(Capability.TRANSACTIONS, "start", "connection=", wf)

    def _new_run(self, wf: Workflow, data: dict[str, Any], key: str | None) -> dict[str, Any]:
        """A new run's row; InvalidStart if a step cannot take ``data`` (every path that makes
        a run comes here before it writes: start, rerun, children, schedule fires)."""
        wf.check_fits(data)
        run = {
            "id": new_run_id(),
            "workflow": wf.name,
            "status": "pending",
            "step_name": wf.steps[0].name if wf.steps else None,
            "input": data,
            "context": {},
            "key": key,
            "created_at": Clock(),
            "due_at": Clock(),
            "published": True,
            "queue": queue_of(self, wf, 0),
        }
        if wf.timeout and not (wf.debounce and key is not None):
            run["deadline_at"] = Clock(wf.timeout)
        if wf.debounce and key is not None:
            # Due after the period, never later than the timeout from this first start.
            run.update(due_at=Clock(wf.debounce["period"]), published=False)
            if wf.debounce.get("timeout"):
                run["not_after"] = Clock(wf.debounce["timeout"])
        return run

    def publish_named(
        self, workflow: str, run_id: str, step_index: int, attempt: int, key: str | None, soon: bool = False
    ) -> bool:
        """Send the message for one step of a run of the named workflow, if it is defined here;
        ``soon``: hand it to the background publisher (``publish_in_background``) and return."""
        wf = self.workflows.get(workflow)
        if wf is None or step_index >= len(wf.steps):
            return False  # the relay of a node that knows the workflow sends it
        if soon and self.settings.publish_in_background and not (self.inline or self.eager):
            self.publisher.send_soon(self._message(wf, step_index, run_id, attempt, key, soon=True))
            return True
        return self.publish(wf, step_index, run_id, attempt, key)

    def publish(
        self,
        workflow: Workflow,
        step_index: int,
        run_id: str,
        attempt: int,
        key: str | None,
        compensate: bool = False,
    ) -> bool:
        """Send the message for one step (or its compensation) now; on failure flag the run for
        the relay. Inline (a Fake, eager mode) nothing is sent: the due run is taken from the
        database by whoever runs steps in the calling thread."""
        if self.inline or self.eager:
            return True
        return self.publisher.send_now(self._message(workflow, step_index, run_id, attempt, key, compensate))

    def _message(
        self,
        workflow: Workflow,
        step_index: int,
        run_id: str,
        attempt: int,
        key: str | None,
        compensate: bool = False,
        soon: bool = False,
    ) -> Message:
        step = workflow.steps[step_index]
        queue = workflow.queue_for(step, None)
        # What send_task would read from this thread: the task sending it (Flower's parent and
        # root), and for the publisher's thread, the caller's OpenTelemetry context.
        parent = self.app.current_worker_task
        request = parent.request if parent is not None else None
        return Message(
            step.task_name,
            step.name,
            step_index,
            run_id,
            attempt,
            key,
            queue,
            compensate,
            parent_id=request.id if request is not None else None,
            root_id=(request.root_id or request.id) if request is not None else None,
            context=tracing.caller_context() if soon else None,
        )

    def _flag_unsent(self, run_ids: Sequence[str]) -> None:
        with self.db.begin() as conn:
            queries.mark_unsent(conn, run_ids)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message this process queued to publish is sent (or flagged for the
        relay); False if ``timeout`` seconds passed first. Exiting the process does it too."""
        return self.publisher.flush(timeout)

    def backoff(self, step: Step, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1`` of ``step``."""
        base = step.backoff or self.settings.backoff_base
        return float(min(base * 2 ** (attempt - 1), self.settings.backoff_max))

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
    ) -> list[Run]:
        """Runs matching the filters, newest first."""
        statuses = [status] if isinstance(status, str) else status
        for value in statuses or ():
            if value not in STATUSES:
                raise InvalidArgument(f"unknown status {value!r}; one of {STATUSES}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidArgument(f"limit must be a positive int, not {limit!r}")
        with self.db.engine.connect() as conn:
            rows = queries.fetch_runs(conn, workflow=workflow, key=key, status=statuses, limit=limit)
        return [Run.from_row(r) for r in rows]

    def list_steps(self, run_id: str) -> list[StepRecord]:
        """Every recorded step attempt of a run, in order; RunNotFound if there is no run."""
        run = self.get_run(run_id)
        with self.db.engine.connect() as conn:
            return [StepRecord.from_row(r, run.input) for r in queries.fetch_steps(conn, run_id)]

    # -- control ----------------------------------------------------------------------------

    def cancel(self, run_id: str) -> bool:
        """Cancel an unfinished run; False if it had already finished. RunNotFound if none."""
        return control.cancel(self, run_id)

    def retry(self, run_id: str) -> str:
        """Resume a failed run from its failed step; KeyTaken if a newer run keeps its key,
        InvalidStart if its input no longer fits the workflow's steps."""
        run = self.get_run(run_id)
        workflow = self.workflows.get(run.workflow)
        if workflow is not None:
            workflow.check_fits(run.input)  # the steps changed since it started: retrying cannot help
        return control.retry(self, run_id)

    def rerun(self, run_id: str) -> str:
        """Start a fresh copy of a finished run with its input and key; KeyTaken if held."""
        return control.rerun(self, run_id)

    def release_key(self, run_id: str, by: str | None = None) -> None:
        """Free a finished run's key (NotFinished, NoKey otherwise); ``by`` is recorded."""
        control.release_key(self, run_id, by)

    def drain(self) -> None:
        """Shut down the worker this code runs in, gracefully: stop taking work, give running
        steps ``shutdown_grace_period`` seconds, then hand the rest back."""
        from celery.worker import state

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
        return control.send_event(self, run_id, name, payload, buffer)

    def provide_input(self, run_id: str, name: str, value: Any = None) -> bool:
        """Give a run the input ``name`` it waits for (kept if it is not waiting yet)."""
        self.require(Capability.WAITS, "provide_input", "waiting for input", self._workflow_of(run_id))
        return control.provide_input(self, run_id, name, value)

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
        return observe.list_pending_inputs(self, workflow, limit)

    # -- watching ---------------------------------------------------------------------------

    def activity(
        self, kinds: Any = None, run_id: str | None = None, workflow: str | None = None, limit: int = 100
    ) -> list[Activity]:
        """Activity entries (key decisions and more), newest first."""
        return observe.list_activity(self, kinds, run_id, workflow, limit)

    def list_keys(
        self, workflow: str | None = None, limit: int = 1000, *, prefix: str | None = None
    ) -> list[KeyEntry]:
        """Held keys with their holder, whether each blocks a new start, runs per key and
        re-adds in the last day; ``prefix`` keeps the keys that start with it."""
        return observe.list_keys(self, workflow, limit, prefix=prefix)

    def count_runs(self) -> dict[tuple[str, str], int]:
        """How many runs each workflow has in each status."""
        with self.db.engine.connect() as conn:
            return queries.count_runs_by_status(conn)

    # -- operations -------------------------------------------------------------------------

    def migrate(self, progress: Callable[[str], None] | None = None) -> list[str]:
        """Bring the database schema up to date; returns the revisions applied."""
        return migrations.upgrade(self.db, progress)

    def pending_migrations(self) -> list[str]:
        """Revisions the database still lacks (empty when up to date)."""
        return migrations.pending_revisions(self.db)

    # == watching: log capture, metrics, doctor and status (logs.py, metrics.py, doctor.py) ====

    def _setup_watching(self) -> None:
        from .logs import LogCapture

        self.log_capture = LogCapture.from_setting(self.settings.log_capture)
        self._metrics: DurableMetrics | None = None
        port = self.settings.metrics_port
        if port is not None:
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise InvalidDefinition(f"metrics_port must be a port number, not {port!r}")
            from .metrics import serve_from_worker

            self.metrics  # noqa: B018 - counters must exist before the first step is counted
            serve_from_worker(self, port)

    @property
    def metrics(self) -> DurableMetrics:
        """Prometheus metrics (``DurableMetrics``; needs the ``[metrics]`` extra)."""
        if self._metrics is None:
            from .metrics import DurableMetrics

            self._metrics = DurableMetrics(self)
        return self._metrics

    def doctor(self, fix: bool = False) -> list[Finding]:
        """Stuck state as ``Finding`` records; ``fix=True`` repairs what is safe and marks it."""
        from .doctor import doctor

        return doctor(self, fix=fix)

    def status_summary(self) -> dict[str, Any]:
        """Runs per status, ready backlog, oldest ready run, stale locks, nodes, schedules."""
        from .doctor import summary

        return summary(self)

    # -- keyed schedules (see schedules.py and docs/schedules.md) ----------------------------

    def beat_entry(
        self,
        workflow: str | Workflow,
        schedule: Any,
        key: str | None = None,
        input: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> dict[str, Any]:
        """An ``app.conf.beat_schedule`` entry whose fires start ``workflow`` with ``key``."""
        self._check_schedule("beat_entry", workflow, key)
        return schedules.beat_entry(self, workflow, schedule, key, input, name)

    def schedule(
        self,
        workflow: str | Workflow,
        cron: Any,
        key: str | None = None,
        input: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> Schedule:
        """Create (or redefine) a schedule at run time: a RedBeat entry, or a row DurableScheduler reads."""
        self._check_schedule("schedule", workflow, key)
        return schedules.create(self, workflow, cron, key, input, name)

    def _check_schedule(self, operation: str, workflow: str | Workflow, key: str | None) -> None:
        """Unsupported when a schedule, or its key, needs a capability this Durable lacks."""
        self.require(Capability.SCHEDULES, operation, "schedules", self._name_of(workflow))
        if key is not None:
            self.require(Capability.IDEMPOTENCY_KEY, operation, "key", self._name_of(workflow))

    @staticmethod
    def _name_of(workflow: str | Workflow) -> str | None:
        return workflow.name if isinstance(workflow, Workflow) else workflow

    def list_schedules(self) -> list[Schedule]:
        """Every keyed schedule (configured and run-time), by name."""
        return schedules.list_all(self)

    def get_schedule(self, name: str) -> Schedule:
        """One schedule by name; ScheduleNotFound if there is none."""
        return schedules.get(self, name)

    def update_schedule(
        self, name: str, cron: Any = UNSET, *, workflow: Any = UNSET, key: Any = UNSET, input: Any = UNSET
    ) -> Schedule:
        """Change a run-time schedule's timing, workflow, key or input; the next fire uses them."""
        if key is not UNSET and key is not None:
            self.require(Capability.IDEMPOTENCY_KEY, "update_schedule", "key", None)
        return schedules.update(self, name, cron, workflow, key, input)

    def enable_schedule(self, name: str) -> Schedule:
        """Switch a schedule on again; its failure count starts from 0."""
        return schedules.switch(self, name, True)

    def disable_schedule(self, name: str) -> Schedule:
        """Switch a schedule off: its fires start nothing until it is enabled."""
        return schedules.switch(self, name, False)

    def delete_schedule(self, name: str) -> bool:
        """Delete a run-time schedule and its state; False if there was none."""
        return schedules.remove(self, name)

    def trigger_schedule(self, name: str) -> str:
        """Fire a schedule now, with its key: the run id started or the key's holder's id."""
        return schedules.trigger(self, name)

    # -- running in production: retention, queues, nodes (prune.py, queues.py, nodes.py) ---

    def prune(self, progress: Callable[[str], None] | None = None) -> dict[str, int]:
        """Run the configured ``prune=`` rules now; returns runs deleted per rule."""
        from . import prune

        return prune.prune(self, progress)

    def cleanup(
        self,
        older_than: Any,
        statuses: Any = None,
        *,
        dry_run: bool = False,
        progress: Callable[[str], None] | None = None,
    ) -> dict[str, int]:
        """Delete finished runs older than ``older_than`` (e.g. ``"30d"``); counts runs, steps, events."""
        from . import prune

        return prune.cleanup(self, older_than, statuses, dry_run=dry_run, progress=progress)

    def pause_queue(self, name: str) -> None:
        """Stop every worker from running steps of queue ``name`` until it is resumed."""
        from . import queues

        queues.pause_queue(self, name)

    def resume_queue(self, name: str) -> int:
        """Let workers run queue ``name`` again; returns how many ready runs were sent again."""
        from . import queues

        return queues.resume_queue(self, name)

    def list_nodes(self) -> list[dict[str, Any]]:
        """Worker nodes seen in the last day: name, queues, pid, draining, started_at, seen_at."""
        from .store import node_rows

        with self.db.engine.connect() as conn:
            return [dict(r._mapping) for r in node_rows.list_nodes(conn)]


def live_durables() -> list[Durable]:
    """Every ``Durable`` alive in this process."""
    return list(_live)


def durable_for_current_app() -> Durable:
    """The ``Durable`` bound to Celery's current app, or NotConfigured."""
    from celery import current_app

    app = current_app._get_current_object()
    durable = getattr(app, "_durable", None)
    if durable is None:
        raise NotConfigured(
            f"no Durable is configured for Celery app {app.main!r}: create Durable(app) "
            "before starting workflows defined with durable_workflow"
        )
    return durable


def durable_workflow(name: str | Callable[..., Any] | None = None, **options: Any) -> Any:
    """Define a workflow bound to whichever app's ``Durable`` is current, like ``shared_task``."""

    def define(fn: Callable[..., Any]) -> Workflow:
        workflow = Workflow(name=name if isinstance(name, str) else None, **options)
        workflow.shared = True
        workflow(fn)
        _shared.append(workflow)
        for durable in list(_live):
            durable._register_workflow(workflow)
        return workflow

    if callable(name):
        fn, name = name, None
        return define(fn)
    return define
