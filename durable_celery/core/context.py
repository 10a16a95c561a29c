"""``current_run()``: what a step sees of the run it belongs to."""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..capabilities import Capability
from ..errors import DurableError
from .run_state import RunState
from .waits import MISSING

if TYPE_CHECKING:
    from sqlalchemy import Connection
    from sqlalchemy.orm import Session

    from ..definition import Step, Workflow
    from .heartbeat import ActiveStep

_current: ContextVar[RunContext | None] = ContextVar("durable_current_run", default=None)

PROGRESS_BYTES = 4096  # the most JSON set_progress keeps


@dataclass
class RunContext(RunState):
    """The run a step is executing for (``current_run()``): ids, input, the shared context dict
    and the attempt, and what a step may do with its run (wait, sleep, snooze, start children)."""

    @property
    def connection(self) -> Connection:
        """An atomic step's SQLAlchemy connection, in the transaction that commits with durable's
        record of the step; InvalidArgument in any other step."""
        if self._transaction is None:
            from ..errors import InvalidArgument

            raise InvalidArgument(
                f"current_run().connection is only there in an atomic step: define step {self.step!r} "
                "with @wf.step(atomic=True) to write in the transaction that records it (or open a "
                "connection of your own, whose writes then happen once per attempt)"
            )
        return self._transaction.conn  # type: ignore[no-any-return]

    def session(self) -> Session:
        """An ORM Session on ``connection`` (atomic steps): durable flushes it before it records
        the step and commits both; the step does not commit it."""
        self.connection  # noqa: B018  (InvalidArgument outside an atomic step)
        return self._transaction.session()  # type: ignore[no-any-return]

    def set_progress(self, value: Any) -> None:
        """Tell callers how far the step got: JSON of at most 4 KB, shown by ``get_run(id).progress``,
        the dashboard and the admin until the next call; InvalidArgument for anything else."""
        import json

        from ..errors import InvalidArgument
        from ..store import answer_rows

        try:
            size = len(json.dumps(value, allow_nan=False).encode())
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"set_progress takes JSON (a dict, list, str, number): {exc}") from None
        if size > PROGRESS_BYTES:
            raise InvalidArgument(f"set_progress takes at most {PROGRESS_BYTES} bytes of JSON, not {size}")
        db = self._active.engine.db
        with db.single() as conn:
            answer_rows.set_progress(conn, self.id, self._active.fence, self._active.holder, value)

    def shutting_down(self) -> bool:
        """True once this worker is shutting down: a long step may stop early and ``snooze``
        (otherwise it is stopped and handed back when the grace period ends)."""
        return self._active.engine.shutting_down()

    def heartbeat(self) -> None:
        """Prove this step is alive; raises RunStopped if the run was cancelled or taken over."""
        self._active.heartbeat_now()

    def wait_for_event(self, name: str, timeout: float | None = None, timeout_value: Any = MISSING) -> Any:
        """The payload of event ``name``; the run parks (worker freed) until it comes.

        On timeout it returns ``timeout_value``, or fails the step with EventTimeout if none
        was given. A run gets one event per name: the newest kept when it first waits.
        """
        from .waits import wait_for_event

        self._require(Capability.EVENTS | Capability.WAITS, "wait_for_event", "waiting for an event")
        return wait_for_event(self, name, timeout, timeout_value)

    def wait_for_input(self, name: str, timeout: float | None = None) -> Any:
        """The value someone gives with ``durable.provide_input(run_id, name, value)``; the run
        parks (worker freed) until then. EventTimeout if ``timeout`` passes first."""
        from .waits import wait_for_input

        self._require(Capability.WAITS, "wait_for_input", "waiting for input")
        return wait_for_input(self, name, timeout)

    def sleep(self, seconds: float) -> None:
        """Park the run for ``seconds`` without holding a worker; the step then resumes."""
        from .waits import sleep

        self._require(Capability.WAITS, "sleep", "sleeping")
        sleep(self, seconds)

    def sleep_until(self, when: datetime) -> None:
        """Park the run until ``when`` (a timezone-aware datetime)."""
        from ..errors import InvalidArgument

        if not isinstance(when, datetime) or when.tzinfo is None:
            raise InvalidArgument("sleep_until needs a timezone-aware datetime")
        self._require(Capability.WAITS, "sleep_until", "sleeping")
        self.sleep((when - self._active.engine.db.utcnow()).total_seconds())

    def snooze(self, seconds: float, reason: str | None = None) -> None:
        """Stop this step now and run it again from the top after ``seconds``, without using
        an attempt (e.g. a rate limit, or the worker shutting down)."""
        from ..errors import InvalidArgument
        from .waits import Snoozed

        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise InvalidArgument(f"seconds must be a number >= 0, not {seconds!r}")
        self._require(Capability.WAITS, "snooze", "snoozing")
        raise Snoozed(float(seconds), reason)

    def call_workflow(
        self, workflow: str | Workflow, input: Mapping[str, Any] | None = None, *, key: str | None = None
    ) -> Any:
        """Start ``workflow`` as a child and wait (worker freed) for its output; raises
        ChildFailed if it ends any other way. Running this step again never starts it twice."""
        from .children import call_workflow

        self._require(Capability.CHILDREN, "call_workflow", "child workflows")
        return call_workflow(self, workflow, input, key)

    def start_workflow(
        self, workflow: str | Workflow, input: Mapping[str, Any] | None = None, *, key: str | None = None
    ) -> str:
        """Start ``workflow`` as a child without waiting; returns its id (the same id when
        this step runs again)."""
        from .children import start_workflow

        self._require(Capability.CHILDREN, "start_workflow", "child workflows")
        return start_workflow(self, workflow, input, key)

    def parallel(self, calls: Any, *, fail_fast: bool = True) -> Any:
        """Run branches (``[(workflow, input), ...]`` or ``{name: (workflow, input)}``) at once
        as their own tasks and wait for all; returns their outputs in the same shape. With
        ``fail_fast`` the first failed branch cancels the others and raises ChildFailed."""
        from .children import parallel

        self._require(Capability.CHILDREN, "parallel", "parallel branches")
        return parallel(self, calls, fail_fast)

    def _require(self, needed: Capability, operation: str, what: str) -> None:
        self._active.engine.rt.require(needed, operation, what, self.workflow)


def current_run() -> RunContext:
    """The run of the step being executed; raises DurableError outside a step."""
    run = _current.get()
    if run is None:
        raise DurableError("current_run() is only available inside a durable step")
    return run


def enter(run: RunContext) -> Any:
    """Make ``run`` current; returns a token for :func:`leave`."""
    return _current.set(run)


def leave(token: Any) -> None:
    """Restore what was current before :func:`enter`."""
    _current.reset(token)


def context_of(row: Any, step: Step, active: ActiveStep | None) -> RunContext:
    """What ``current_run()`` shows a step of the claimed ``row``."""
    return RunContext(
        id=row.id,
        workflow=row.workflow,
        input=dict(row.input),
        context=dict(row.context),
        attempt=row.attempt,
        key=row.key,
        step=step.name,
        _active=active,  # type: ignore[arg-type]  # None: nothing runs (a lost process's step)
        _resumed_wait=row.wait_name,
        _step_index=step.index,
        _parent_id=row.parent_id,
    )
