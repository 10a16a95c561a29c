"""Testing code that uses durable_celery (docs/testing.md has the four ways):

* ``run_context(...)``: call one step function directly, as a worker would;
* ``Fake``: a ``Durable`` on the in-memory store whose steps run in the calling thread when
  told (``run_until_idle()``), on a clock the test moves (``advance(seconds)``);
* eager mode: ``app.conf.task_always_eager = True`` and ``start()`` runs the run's steps;
* ``worker(durable)``: a real Celery worker in this process, and ``wait_for`` a run's end;

and ``RecordingOutbox``, given as ``Durable(app, url, outbox=RecordingOutbox())``: the step
messages a Durable would send, recorded instead of sent.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.worker import state as worker_state
from kombu.asynchronous import set_event_loop

from .app import Durable
from .capabilities import Capability, require
from .core.context import RunContext, enter, leave
from .core.eager import MAX_STEPS, run_due, sweep
from .definition import Workflow
from .errors import InvalidArgument
from .models import Run
from .observe.why import stuck_words
from .store.schema import FINISHED

WAKE_TASK = "durable.testing.wake"


@dataclass(frozen=True)
class Sent:
    """One step message handed to a ``RecordingOutbox``."""

    workflow: str
    step_index: int
    run_id: str
    attempt: int
    key: str | None
    compensate: bool = False
    soon: bool = False  # handed to the background publisher (a worker's wake-ups, control's sends)


class RecordingOutbox:
    """An outbox that records every step message instead of sending it.

    ``accept`` (a function of the ``Sent``) says whether the broker would take it: False stands
    for a broker that refused it, and the run is then left for the relay, as it would be.
    """

    def __init__(self, accept: Callable[[Sent], bool] | None = None) -> None:
        self.sent: list[Sent] = []
        self.accept = accept
        self.inline = False
        self._lock = threading.Lock()

    @property
    def eager(self) -> bool:
        """Never eager: recorded messages run nowhere."""
        return False

    @property
    def sends_ahead(self) -> bool:
        """Never ahead: a message is recorded once its start committed."""
        return False

    def send(
        self,
        workflow: Workflow,
        step_index: int,
        run_id: str,
        attempt: int,
        key: str | None,
        compensate: bool = False,
    ) -> bool:
        """Record one step's message; whether it was "sent" is ``accept``'s answer (True)."""
        return self._record(Sent(workflow.name or "", step_index, run_id, attempt, key, compensate))

    def send_named(
        self, workflow: str, run_id: str, step_index: int, attempt: int, key: str | None, soon: bool = False
    ) -> bool:
        """Record one step's message of the named workflow."""
        return self._record(Sent(workflow, step_index, run_id, attempt, key, soon=soon))

    def flush(self, timeout: float | None = None) -> bool:
        """Nothing waits to be sent: True."""
        return True

    def gathering(self) -> AbstractContextManager[None]:
        """Messages are recorded as they come: nothing to gather."""
        return nullcontext()

    def run_ids(self) -> list[str]:
        """The run ids of the messages recorded, in order."""
        with self._lock:
            return [sent.run_id for sent in self.sent]

    def clear(self) -> None:
        """Forget what was recorded."""
        with self._lock:
            self.sent.clear()

    def _record(self, sent: Sent) -> bool:
        with self._lock:
            self.sent.append(sent)
        return True if self.accept is None else bool(self.accept(sent))


@contextmanager
def worker(
    durable: Durable,
    *,
    concurrency: int = 2,
    pool: str = "threads",
    queues: list[str] | None = None,
    **options: Any,
) -> Iterator[Any]:
    """Run a real Celery worker (thread pool) for ``durable.app`` inside this process; for a
    ``Fake``, run its due steps in a background thread with its clock following real time.

    Leaving the block stops every in-process worker (Celery's stop flag is process-wide):
    start several at once in one ``with`` rather than nesting them."""
    if isinstance(durable, Fake):
        with durable.running():
            yield None
        return
    # Celery's worker reuses the process's current kombu event loop when one is set; two
    # workers running at once in one process would then drive one hub from two threads (and
    # block on each other's sockets). Each worker started here gets a hub of its own.
    set_event_loop(None)
    # What this process started before is sent first: the worker's start opens and closes a
    # broker connection, and kombu's in-memory transport closes its channels by walking a
    # queue table that a send from the publisher thread could be adding to at that moment.
    durable.flush(timeout=10)
    if queues:
        options["queues"] = queues
    if WAKE_TASK not in durable.app.tasks:
        durable.app.task(name=WAKE_TASK, shared=False, ignore_result=True)(_noop)
    with start_worker(
        durable.app,
        concurrency=concurrency,
        pool=pool,
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=30,
        **options,
    ) as controller:

        def learn_new_tasks() -> None:  # steps defined after the worker started
            consumer = getattr(controller, "consumer", None)
            if consumer is not None and getattr(consumer, "strategies", None) is not None:
                consumer.update_strategies()

        durable.on_new_task.append(learn_new_tasks)
        try:
            yield controller
        finally:
            durable.on_new_task.remove(learn_new_tasks)
            worker_state.should_terminate = 0  # what start_worker sets on exit, set first
            _wake(durable, queues, controller)


def _wake(durable: Durable, queues: list[str] | None, controller: Any) -> None:
    # The consumer's event loop (Redis, RabbitMQ) polls its sockets for up to 10 s when no
    # timer is due sooner: a callback handed to it ends that wait, so it sees the stop at once.
    hub = getattr(controller, "hub", None)
    if hub is not None:
        hub.call_soon(_noop)
    # Transports without push (memory, filesystem) poll with a 2 s timeout, and the consumer
    # loop drains once more after it notices the stop: two messages end both waits at once.
    if durable.app.conf.broker_url.split(":", 1)[0] in ("memory", "filesystem", "durablefs"):
        for queue in queues or [durable.app.conf.task_default_queue]:
            for _ in range(2):
                durable.app.send_task(WAKE_TASK, queue=queue, ignore_result=True)


def _noop() -> None:
    """Does nothing; its message wakes a polling consumer."""


def wait_for(
    durable: Durable, run_id: str, *, statuses: tuple[str, ...] = FINISHED, timeout: float = 30.0
) -> Run:
    """Poll the database until the run reaches one of ``statuses``; raise TimeoutError if not,
    saying what holds the run (a queue no live worker consumes, workers without its code, flow
    control, a retry's backoff, a debounce, a paused queue, what it waits for)."""
    deadline = time.monotonic() + timeout
    while True:
        run = durable.get_run(run_id)
        if run.status in statuses:
            return run
        left = deadline - time.monotonic()
        if left < 0:
            raise TimeoutError(_not_reached(durable, run, statuses, timeout))
        if set(statuses) <= set(FINISHED):  # an end: waited for as ``result`` waits
            durable.answers.wait(run_id, left)
        else:
            time.sleep(0.05)


def _not_reached(durable: Durable, run: Run, statuses: tuple[str, ...], timeout: float) -> str:
    """The TimeoutError's message: where the run is, and why when it can be told."""
    said = f"run {run.id} is {run.status} after {timeout}s, not {statuses}"
    try:
        # A Fake runs steps in the test's thread: no worker node is looked for.
        why = stuck_words(durable.runtime, run, durable.list_steps(run.id), not isinstance(durable, Fake))
    except Exception as exc:  # the database went away: the timeout is still the error to raise
        why = f"(why is unknown: {type(exc).__name__}: {exc})"
    return f"{said}: {why}" if why else said


# -- the Fake ---------------------------------------------------------------------------------


class FakeClock:
    """The time a Fake's store sees: starts at the real time and moves only by ``advance``,
    except while it follows real time (``Fake.running``)."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime.now(timezone.utc)
        if self._now.tzinfo is None:
            raise InvalidArgument("a FakeClock starts at a timezone-aware datetime")
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic time it started following real time

    def __call__(self) -> datetime:
        with self._lock:
            return self._read()

    def _read(self) -> datetime:
        if self._since is None:
            return self._now
        return self._now + timedelta(seconds=time.monotonic() - self._since)

    def advance(self, seconds: float) -> datetime:
        """Move the clock ``seconds`` forward; returns the new time."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise InvalidArgument(f"seconds must be a number >= 0, not {seconds!r}")
        with self._lock:
            self._now += timedelta(seconds=seconds)
            return self._read()

    def follow_real_time(self, on: bool) -> None:
        """Start (or stop) moving with real time from where the clock is."""
        with self._lock:
            self._now = self._read()
            self._since = time.monotonic() if on else None


class Fake(Durable):
    """A ``Durable`` for unit tests: the in-memory store, steps run in the calling thread.

    Everything a ``Durable`` has works the same (definitions, ``start`` and every key rule,
    reading, control); nothing is sent to a broker. ``run_until_idle()`` runs every due step;
    ``advance(seconds)`` moves the store's clock, so sleeps, debounce, backoff, wait timeouts
    and workflow timeouts come due without waiting. Built with fewer ``capabilities`` it
    refuses what needs the others, as such a backend would (``Unsupported``). Two Fakes
    given the same ``store="memory://NAME"`` share their runs.
    """

    def __init__(
        self,
        app: Celery | None = None,
        *,
        capabilities: Capability = Capability.ALL,
        start_time: datetime | None = None,
        store: str = "memory://",
        **settings: Any,
    ) -> None:
        if app is None:
            name = f"durable-fake-{uuid.uuid4().hex[:8]}"
            app = Celery(name, broker="memory://localhost/", set_as_current=False)
        if not store.startswith("memory://"):
            raise InvalidArgument(f"a Fake keeps its runs in a memory:// store, not {store!r}")
        super().__init__(app, store, capabilities=capabilities, **settings)
        self.inline = True
        self._running = False  # running() runs steps in the background meanwhile
        self.clock = FakeClock(start_time)
        self.db.clock = self.clock

    def __repr__(self) -> str:
        return f"<Fake {self.db.masked_url} at {self.clock().isoformat()}>"

    def register(self, *workflows: Workflow) -> None:
        """Make workflows defined on another Durable (the app's own) known here by name."""
        for workflow in workflows:
            if self.workflows.get(workflow.name or "") is not workflow:
                self.registry.register(workflow)

    def now(self) -> datetime:
        """The Fake's current time."""
        return self.clock()

    def advance(self, seconds: float) -> datetime:
        """Move the clock ``seconds`` forward (steps do not run: call ``run_until_idle``)."""
        return self.clock.advance(seconds)

    def run_until_idle(self, max_steps: int = MAX_STEPS) -> int:
        """Run every due step, and the upkeep sweeps, until nothing is due; returns the steps run."""
        return run_due(self.engine, max_steps=max_steps)

    def result(self, run_id: str, timeout: float | None = None) -> Any:
        """The run's output once it ended (``run_until_idle`` runs it): nothing runs its steps
        meanwhile outside ``running()``, so an unfinished run raises ResultTimeout at once."""
        return super().result(run_id, timeout if self._running else 0)

    async def aresult(self, run_id: str, timeout: float | None = None) -> Any:
        """``result`` for an event loop."""
        return await super().aresult(run_id, timeout if self._running else 0)

    @contextmanager
    def running(self, poll: float = 0.01) -> Iterator[Fake]:
        """Run due steps in a background thread, like a worker, while the block runs; the
        clock follows real time meanwhile (so tests written for a real worker run here too)."""
        stop, failed = threading.Event(), []

        def loop(work: Any) -> None:
            while not stop.is_set():
                try:
                    if not work():
                        stop.wait(poll)
                except Exception as exc:  # a bug in the library, not a failed step: make it loud
                    failed.append(exc)
                    return

        self.clock.follow_real_time(True)
        self._running = True
        # Steps in one thread; the sweeps (workflow timeouts...) beside them, as upkeep does.
        threads = [
            threading.Thread(target=loop, args=(work,), name=f"durable-fake-{name}", daemon=True)
            for name, work in (
                ("runner", lambda: run_due(self.engine)),
                ("sweeper", lambda: sweep(self.runtime)),
            )
        ]
        for thread in threads:
            thread.start()
        try:
            yield self
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
            self._running = False
            self.clock.follow_real_time(False)
        if failed:
            raise failed[0]

    def close(self) -> None:
        """Delete the Fake's store (a store shared by name is deleted for every Fake on it)."""
        self.db.drop_memory_store()


# -- one step, called directly ------------------------------------------------------------------


class Parked(Exception):
    """A step called under ``run_context`` parked the run (it would free its worker here)."""

    def __init__(self, what: str, **details: Any) -> None:
        shown = ", ".join(f"{k}={v!r}" for k, v in details.items())
        super().__init__(f"{what}({shown})")
        self.what = what
        self.details = details


class Sleeping(Parked):
    """The step called ``sleep``/``sleep_until``: ``seconds`` is how long."""

    def __init__(self, seconds: float) -> None:
        super().__init__("sleep", seconds=seconds)
        self.seconds = seconds


class WaitingForEvent(Parked):
    """The step called ``wait_for_event(name, timeout)``."""

    def __init__(self, name: str, timeout: float | None) -> None:
        super().__init__("wait_for_event", name=name, timeout=timeout)
        self.name, self.timeout = name, timeout


class WaitingForInput(Parked):
    """The step called ``wait_for_input(name, timeout)``."""

    def __init__(self, name: str, timeout: float | None) -> None:
        super().__init__("wait_for_input", name=name, timeout=timeout)
        self.name, self.timeout = name, timeout


class Snoozing(Parked):
    """The step called ``snooze(seconds, reason)``."""

    def __init__(self, seconds: float, reason: str | None) -> None:
        super().__init__("snooze", seconds=seconds, reason=reason)
        self.seconds, self.reason = seconds, reason


class CallingWorkflow(Parked):
    """The step called ``call_workflow`` (or ``parallel``) for a child with no result given."""

    def __init__(self, workflow: str, input: Any) -> None:
        super().__init__("call_workflow", workflow=workflow, input=input)
        self.workflow, self.input = workflow, input


@dataclass
class StepCall:
    """What a step under ``run_context`` asked of its run, in order: ``(what, details)``."""

    what: str
    details: dict[str, Any] = field(default_factory=dict)


class TestRun(RunContext):
    """``current_run()`` under ``run_context``: no database; waits raise ``Parked`` subclasses
    unless the test gave what they wait for."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        *,
        events: Mapping[str, Any],
        inputs: Mapping[str, Any],
        children: Mapping[str, Any],
        sleeps_done: int,
        capabilities: Capability,
        **fields_: Any,
    ) -> None:
        super().__init__(_active=None, **fields_)  # type: ignore[arg-type]
        self.events, self.inputs, self.children = dict(events), dict(inputs), dict(children)
        self.sleeps_done = sleeps_done
        self.capabilities = capabilities
        self.calls: list[StepCall] = []
        self.started: list[tuple[str, Any]] = []

    def call(self, target: Any, step: str | None = None) -> Any:
        """Call a step function with this run's input: ``target`` is the function, or a
        Workflow (its step named ``step``, else the first)."""
        if isinstance(target, Workflow):
            found = [s for s in target.steps if step is None or s.name == step]
            if not found:
                raise InvalidArgument(f"workflow {target.name!r} has no step {step!r}")
            self.step = found[0].name
            target = found[0].fn
        return target(**self.input)

    def _note(self, what: str, **details: Any) -> None:
        self.calls.append(StepCall(what, details))

    def _require(self, needed: Capability, operation: str, what: str) -> None:
        require(self.capabilities, needed, operation, what, self.workflow)

    def shutting_down(self) -> bool:
        """Never, under run_context."""
        return False

    def heartbeat(self) -> None:
        """Noted in ``calls``; nothing else."""
        self._note("heartbeat")

    def set_progress(self, value: Any) -> None:
        """Noted (``calls``), and kept as ``progress``: no database here."""
        self._note("set_progress", value=value)
        self.progress = value

    def wait_for_event(self, name: str, timeout: float | None = None, timeout_value: Any = None) -> Any:
        """The payload given in ``events=``, else raises WaitingForEvent."""
        self._require(Capability.EVENTS | Capability.WAITS, "wait_for_event", "waiting for an event")
        self._note("wait_for_event", name=name, timeout=timeout)
        if name in self.events:
            return self.events[name]
        raise WaitingForEvent(name, timeout)

    def wait_for_input(self, name: str, timeout: float | None = None) -> Any:
        """The value given in ``inputs=``, else raises WaitingForInput."""
        self._require(Capability.WAITS, "wait_for_input", "waiting for input")
        self._note("wait_for_input", name=name, timeout=timeout)
        if name in self.inputs:
            return self.inputs[name]
        raise WaitingForInput(name, timeout)

    def sleep(self, seconds: float) -> None:
        """Returns for the first ``sleeps_done`` sleeps (and for 0 s), else raises Sleeping."""
        self._require(Capability.WAITS, "sleep", "sleeping")
        self._note("sleep", seconds=seconds)
        self._sleeps += 1
        if seconds > 0 and self._sleeps > self.sleeps_done:
            raise Sleeping(float(seconds))

    def sleep_until(self, when: datetime) -> None:
        """``sleep`` for the time left until ``when`` on the real clock."""
        if not isinstance(when, datetime) or when.tzinfo is None:
            raise InvalidArgument("sleep_until needs a timezone-aware datetime")
        self.sleep((when - datetime.now(timezone.utc)).total_seconds())

    def snooze(self, seconds: float, reason: str | None = None) -> None:
        """Raises Snoozing."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise InvalidArgument(f"seconds must be a number >= 0, not {seconds!r}")
        self._require(Capability.WAITS, "snooze", "snoozing")
        self._note("snooze", seconds=seconds, reason=reason)
        raise Snoozing(float(seconds), reason)

    def call_workflow(
        self, workflow: Any, input: Mapping[str, Any] | None = None, *, key: str | None = None
    ) -> Any:
        """The result given in ``children=`` under the workflow's name, else CallingWorkflow."""
        self._require(Capability.CHILDREN, "call_workflow", "child workflows")
        name = getattr(workflow, "name", workflow)
        self._note("call_workflow", workflow=name, input=dict(input or {}), key=key)
        if name in self.children:
            return self.children[name]
        raise CallingWorkflow(name, dict(input or {}))

    def start_workflow(
        self, workflow: Any, input: Mapping[str, Any] | None = None, *, key: str | None = None
    ) -> str:
        """Noted in ``started``; returns a made-up run id."""
        self._require(Capability.CHILDREN, "start_workflow", "child workflows")
        name = getattr(workflow, "name", workflow)
        self._note("start_workflow", workflow=name, input=dict(input or {}), key=key)
        self.started.append((name, dict(input or {})))
        return f"child-{len(self.started)}"

    def parallel(self, calls: Any, *, fail_fast: bool = True) -> Any:
        """Each branch's result from ``children=``; CallingWorkflow for the first without one."""
        self._require(Capability.CHILDREN, "parallel", "parallel branches")
        items = calls.items() if isinstance(calls, Mapping) else enumerate(calls)
        results = {k: self.call_workflow(*branch) for k, branch in items}
        return results if isinstance(calls, Mapping) else [results[i] for i in range(len(results))]


@contextmanager
def run_context(
    input: Mapping[str, Any] | None = None,
    *,
    key: str | None = None,
    attempt: int = 1,
    workflow: str = "test",
    step: str = "step",
    run_id: str | None = None,
    context: dict[str, Any] | None = None,
    events: Mapping[str, Any] | None = None,
    inputs: Mapping[str, Any] | None = None,
    children: Mapping[str, Any] | None = None,
    sleeps_done: int = 0,
    parent_id: str | None = None,
    capabilities: Capability = Capability.ALL,
) -> Iterator[TestRun]:
    """Make ``current_run()`` answer as in a worker, so a step function can be called directly.

    Waits the test gave an answer for (``events``, ``inputs``, ``children`` by workflow name,
    the first ``sleeps_done`` sleeps) return it; any other raises a ``Parked`` subclass
    (``Sleeping``, ``WaitingForEvent``, ``WaitingForInput``, ``Snoozing``,
    ``CallingWorkflow``) the test can assert on. ``calls`` lists every request in order.
    """
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise InvalidArgument(f"attempt must be an int >= 1, not {attempt!r}")
    run = TestRun(
        id=run_id or str(uuid.uuid4()),
        workflow=workflow,
        input=dict(input or {}),
        context=context if context is not None else {},
        attempt=attempt,
        key=key,
        step=step,
        _parent_id=parent_id,
        events=events or {},
        inputs=inputs or {},
        children=children or {},
        sleeps_done=sleeps_done,
        capabilities=capabilities,
    )
    token = enter(run)
    try:
        yield run
    finally:
        leave(token)
