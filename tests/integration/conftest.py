"""Fixtures of the integration tests that record what a Durable announces and sends."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from durable_celery import signals

SIGNALS = ("run_started", "run_finished", "key_duplicate", "key_handoff")


class Seen:
    """The signals and messages one Durable sent, in order."""

    def __init__(self, durable: Any) -> None:
        self.durable = durable
        self.signals: list[tuple[str, dict[str, Any]]] = []
        self.published: list[tuple[Any, ...]] = []
        self._receivers = {name: self._receiver(name) for name in SIGNALS}

    def _receiver(self, name: str) -> Any:
        def receive(sender: Any, **kwargs: Any) -> None:
            if sender is self.durable:
                kwargs.pop("signal", None)
                self.signals.append((name, kwargs))

        return receive

    def publish(self, workflow: Any, step_index: int, run_id: str, attempt: int, key: Any, **kw: Any) -> bool:
        self.published.append((workflow.name, step_index, run_id, attempt, key))
        return True

    def publish_named(
        self, workflow: str, run_id: str, step_index: int, attempt: int, key: Any, **kw: Any
    ) -> bool:
        self.published.append((workflow, step_index, run_id, attempt, key))
        return True

    def clear(self) -> None:
        self.signals.clear()
        self.published.clear()


@pytest.fixture
def seen(durable, monkeypatch) -> Iterator[Seen]:
    recorder = Seen(durable)
    monkeypatch.setattr(durable, "publish", recorder.publish)
    monkeypatch.setattr(durable, "publish_named", recorder.publish_named)
    for name, receiver in recorder._receivers.items():
        getattr(signals, name).connect(receiver, weak=False)
    try:
        yield recorder
    finally:
        for name, receiver in recorder._receivers.items():
            getattr(signals, name).disconnect(receiver)
