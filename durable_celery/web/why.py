"""Why a run is not moving, for its page: the parts observe/why.py finds (a retry waiting out
its backoff, a debounce, a queue nobody consumes, consumed only by workers without its code or
paused, the worker running it, the compensation that failed, the flow limit that holds it),
for the ``Durable`` the dashboard serves."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..observe import why
from ..observe.why import consumers

if TYPE_CHECKING:
    from ..app import Durable
    from ..models import Run

__all__ = ["consumers", "live_nodes", "run_state"]


def live_nodes(durable: Durable, now: datetime) -> list[dict[str, Any]]:
    """Nodes seen in the last day, each with ``live`` (seen lately, not draining)."""
    return why.live_nodes(durable.runtime, now)


def run_state(durable: Durable, run: Run, steps: list[Any]) -> dict[str, Any]:
    """What keeps ``run`` where it is: ``label`` and the parts behind it (observe/why.py)."""
    return why.run_state(durable.runtime, run, steps)
