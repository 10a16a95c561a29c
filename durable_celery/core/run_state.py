"""``RunState``: what a step's run holds while the step executes: ids, input, the shared context
dict, the attempt, and the active step (its lock, how to stop it). ``context.RunContext`` adds
the step's API (``current_run()``); waits and children work on the state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .heartbeat import ActiveStep


@dataclass
class RunState:
    """The run a step is executing for: ids, input, the shared context dict and the attempt."""

    id: str
    workflow: str
    input: dict[str, Any]
    context: dict[str, Any]
    attempt: int
    key: str | None
    step: str
    _active: ActiveStep = field(repr=False)
    _resumed_wait: str | None = field(default=None, repr=False)
    _sleeps: int = field(default=0, repr=False)
    _step_index: int = field(default=0, repr=False)
    _parent_id: str | None = field(default=None, repr=False)
    _calls: int = field(default=0, repr=False)
    # An atomic step's open transaction (atomic.StepTransaction), while the step runs.
    _transaction: Any = field(default=None, repr=False)

    @property
    def parent_id(self) -> str | None:
        """The run that started this one as a child or branch, if any."""
        return self._parent_id
