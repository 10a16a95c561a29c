"""``Runtime``: the narrow parts of one ``Durable`` that the core may touch, built once by
``app.py``; and ``Outbox``, the seam where the core hands over step messages."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..capabilities import Capability, require
from ..definition import Registry, Workflow
from ..settings import Settings
from ..store.db import Database

if TYPE_CHECKING:
    from ..instrument.hooks import Instrumentation


class Outbox(Protocol):
    """Where the core hands step messages: Celery in production, a list in tests."""

    # Steps run in the calling thread (a Fake): nothing is sent, the due run is taken from the
    # database by whoever runs steps there.
    inline: bool

    @property
    def eager(self) -> bool:
        """``start()`` runs the run's steps in the calling thread (``task_always_eager``)."""
        ...

    @property
    def sends_ahead(self) -> bool:
        """A start may hand its first step's message over before its row commits: the
        background publisher sends it once the caller waits on the database."""
        ...

    def send(
        self,
        workflow: Workflow,
        step_index: int,
        run_id: str,
        attempt: int,
        key: str | None,
        compensate: bool = False,
    ) -> bool:
        """Send one step's (or its compensation's) message now; False if it was not sent."""
        ...

    def send_named(
        self, workflow: str, run_id: str, step_index: int, attempt: int, key: str | None, soon: bool = False
    ) -> bool:
        """Send a step of the named workflow if it is known here; ``soon``: in the background."""
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message handed over is sent; False if ``timeout`` passed first."""
        ...

    def gathering(self) -> AbstractContextManager[None]:
        """A block whose background sends go out together when it ends (a bulk action's page)."""
        ...


@dataclass(frozen=True, eq=False)
class Runtime:
    """What the core may touch of one Durable; ``app.py`` builds it once."""

    db: Database
    settings: Settings
    registry: Registry
    outbox: Outbox
    instrumentation: Instrumentation
    capabilities: Capability
    # The Celery app's task_default_queue, read when asked (the app may be configured later).
    default_queue: Callable[[], str]
    # Who signals name as their sender (the Durable; opaque here).
    sender: object

    def require(self, needed: Capability, operation: str, what: str, workflow: str | None) -> None:
        """Raise Unsupported (naming ``needed`` and the workflow) unless the backend has it."""
        require(self.capabilities, needed, operation, what, workflow)
