"""Fixtures of the integration tests that record what a Durable announces and sends."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from durable_celery import signals
from durable_celery.testing import RecordingOutbox

SIGNALS = ("run_started", "run_finished", "key_duplicate", "key_handoff")


class Seen:
    """The signals and messages one Durable sent, in order (its outbox records the messages)."""

    def __init__(self, durable: Any) -> None:
        assert isinstance(durable.outbox, RecordingOutbox)
        self.durable = durable
        self.outbox: RecordingOutbox = durable.outbox
        self.outbox.accept = self._sent
        self.signals: list[tuple[str, dict[str, Any]]] = []
        # The messages as (workflow, step index, run id, attempt, key), in order.
        self.published: list[tuple[Any, ...]] = []
        self._receivers = {name: self._receiver(name) for name in SIGNALS}

    def _receiver(self, name: str) -> Any:
        def receive(sender: Any, **kwargs: Any) -> None:
            if sender is self.durable:
                kwargs.pop("signal", None)
                self.signals.append((name, kwargs))

        return receive

    def _sent(self, sent: Any) -> bool:
        self.published.append((sent.workflow, sent.step_index, sent.run_id, sent.attempt, sent.key))
        return True

    def clear(self) -> None:
        self.signals.clear()
        self.published.clear()


@pytest.fixture
def durable(make_durable, request):
    """A Durable on this test's backend; for a test that asks for ``seen``, one whose messages
    are recorded by a RecordingOutbox instead of sent."""
    if "seen" in request.fixturenames:
        return make_durable(outbox=RecordingOutbox())
    return make_durable()


@pytest.fixture
def seen(durable) -> Iterator[Seen]:
    recorder = Seen(durable)
    for name, receiver in recorder._receivers.items():
        getattr(signals, name).connect(receiver, weak=False)
    try:
        yield recorder
    finally:
        for name, receiver in recorder._receivers.items():
            getattr(signals, name).disconnect(receiver)
