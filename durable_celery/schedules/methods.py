"""The ``Durable`` methods of keyed schedules (docs/schedules.md): a mixin of ``app.Durable``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import schedules
from ..capabilities import Capability
from ..definition import Workflow
from . import UNSET, Schedule

if TYPE_CHECKING:
    from celery import Celery

    from ..core.runtime import Runtime


class ScheduleMethods:
    """Create, read, change and fire keyed schedules (RedBeat entries, or rows DurableScheduler reads)."""

    runtime: Runtime
    app: Celery

    def require(self, needed: Capability, operation: str, what: str, workflow: str | None) -> None:
        """Unsupported unless the backend has ``needed`` (the Durable's)."""
        raise NotImplementedError

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
        return schedules.beat_entry(self.runtime, self.app, workflow, schedule, key, input, name)

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
        return schedules.create(self.runtime, self.app, workflow, cron, key, input, name)

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
        return schedules.list_all(self.runtime, self.app)

    def get_schedule(self, name: str) -> Schedule:
        """One schedule by name; ScheduleNotFound if there is none."""
        return schedules.get(self.runtime, self.app, name)

    def update_schedule(
        self, name: str, cron: Any = UNSET, *, workflow: Any = UNSET, key: Any = UNSET, input: Any = UNSET
    ) -> Schedule:
        """Change a run-time schedule's timing, workflow, key or input; the next fire uses them."""
        if key is not UNSET and key is not None:
            self.require(Capability.IDEMPOTENCY_KEY, "update_schedule", "key", None)
        return schedules.update(self.runtime, self.app, name, cron, workflow, key, input)

    def enable_schedule(self, name: str) -> Schedule:
        """Switch a schedule on again; its failure count starts from 0."""
        return schedules.switch(self.runtime, self.app, name, True)

    def disable_schedule(self, name: str) -> Schedule:
        """Switch a schedule off: its fires start nothing until it is enabled."""
        return schedules.switch(self.runtime, self.app, name, False)

    def delete_schedule(self, name: str) -> bool:
        """Delete a run-time schedule and its state; False if there was none."""
        return schedules.remove(self.runtime, self.app, name)

    def trigger_schedule(self, name: str) -> str:
        """Fire a schedule now, with its key: the run id started or the key's holder's id."""
        return schedules.trigger(self.runtime, self.app, name)
