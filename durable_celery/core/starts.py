"""``Starter``: every start's one path: check, key, policy, the run's row, its trace, the key
decision, and what the commit sets off (messages, signals; in eager mode the steps)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..capabilities import Capability
from ..definition import SendEvent, Workflow, check_on_duplicate
from ..errors import InvalidStart
from ..inputs import check_input, check_tags
from ..limits import check_priority
from . import atomic
from .batches import first_item
from .control import after_commit
from .eager import run_eagerly
from .keys import start_run
from .runs import new_run
from .transactions import start_in_callers_transaction

if TYPE_CHECKING:
    from .engine import Engine
    from .runtime import Runtime


class Starter:
    """Starts runs for one Durable: ``Durable.start`` and ``Workflow.start`` come here."""

    def __init__(self, rt: Runtime, engine: Engine) -> None:
        self.rt = rt
        self.engine = engine
        # The caller's open transaction a start without ``connection=`` joins, if any (a
        # JoinedTransaction, or None: contrib.django sets it to Django's atomic block).
        self.ambient: Callable[[], Any] | None = None

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
        """Start a run and return its id, or the id the key's holder answers with."""
        rt = self.rt
        wf = rt.registry.resolve(workflow)
        data = check_input(input, rt.settings.max_input_bytes)
        run_tags = check_tags(tags)
        rank = None if priority is None else check_priority(priority, InvalidStart)
        batch_key = None
        if wf.batch is not None:  # gathered with the other starts of its batch key (batches.py)
            data, batch_key = first_item(wf, data, key)
        run_key = None if wf.batch is not None else wf.derive_key(data, key)
        policy = wf.on_duplicate if on_duplicate is None else check_on_duplicate(on_duplicate, wf)
        if connection is None:  # inside an atomic step, or the caller's ambient transaction
            connection = atomic.current() or (self.ambient() if self.ambient is not None else None)
        self._check(wf, run_key, policy, connection)
        aging = rt.settings.priority_aging
        run = new_run(rt.default_queue(), wf, data, run_key, run_tags, rank, aging, batch_key)
        rt.instrumentation.stamp_run(wf, run)  # the run's trace (tracing.py)
        if connection is not None:
            return start_in_callers_transaction(rt, connection, wf, run, policy)
        decision = start_run(rt, wf, run, policy)
        after_commit(rt, decision)
        if decision.created and rt.outbox.eager and not rt.outbox.inline:  # a duplicate runs nothing
            run_eagerly(self.engine, decision.run_id)
        return decision.run_id

    def _check(self, wf: Workflow, key: str | None, policy: Any, connection: Any) -> None:
        """Unsupported when the start needs a capability this Durable lacks."""
        if key is not None:
            self.rt.require(Capability.IDEMPOTENCY_KEY, "start", "key", wf.name)
            if isinstance(policy, SendEvent):
                self.rt.require(Capability.EVENTS, "start", "on_duplicate=SendEvent", wf.name)
        if connection is not None:
            self.rt.require(Capability.TRANSACTIONS, "start", "connection=", wf.name)
        if any(step.atomic for step in wf.steps):
            self.rt.require(Capability.ATOMIC_STEPS, "start", "atomic steps (PostgreSQL only)", wf.name)
        for kind in ("concurrency", "throttle", "rate_limit", "batch"):
            if getattr(wf, kind) is not None:
                self.rt.require(Capability.FLOW_CONTROL, "start", f"{kind}=", wf.name)
