"""What a step is shown and what its attempts announce: ``current_run()`` as claimed (id,
workflow, input, context so far, key, attempt, step), ``step_started`` and ``step_finished``
with their fields.

Steps run through ``run_message``, as a worker runs a message, in the test's thread, on both
backends. Written against mutants of durable_celery/core/engine.py that the behaviour tests
let through."""

from __future__ import annotations

import time
from typing import Any

import pytest

from durable_celery import current_run, signals
from tests.integration.core.helpers import set_losses

pytestmark = pytest.mark.timeout(60)


def test_current_run_shows_a_step_its_run_as_claimed(durable):
    """``current_run()``: the run's id, workflow, input, context so far, key and attempt, and
    the step's own name (a keyed run here, on its second step, second attempt)."""
    seen: list[dict[str, Any]] = []
    wf = durable.workflow("shown")

    @wf.step
    def first(order):
        current_run().context["charged"] = order
        return 1

    @wf.step(retry=2, backoff=30)
    def second(order):
        run = current_run()
        seen.append(
            {
                "id": run.id,
                "workflow": run.workflow,
                "input": run.input,
                "context": dict(run.context),
                "attempt": run.attempt,
                "key": run.key,
                "step": run.step,
                "parent_id": run.parent_id,
            }
        )
        if run.attempt == 1:
            raise RuntimeError("once")

    run_id = durable.start(wf, {"order": 7}, key="order:7")
    assert durable.run_message("shown", 0, run_id) == "running"
    assert durable.run_message("shown", 1, run_id) == "retrying"
    set_losses(durable, run_id)  # due now
    assert durable.run_message("shown", 1, run_id) == "completed"
    shown = {
        "id": run_id,
        "workflow": "shown",
        "input": {"order": 7},
        "context": {"charged": 7},
        "key": "order:7",
        "step": "second",
        "parent_id": None,
    }
    assert seen == [{**shown, "attempt": 1}, {**shown, "attempt": 2}]


def test_step_started_names_the_run_workflow_step_and_attempt(durable):
    started: list[dict[str, Any]] = []

    def note(sender: Any, **kwargs: Any) -> None:
        if sender is durable:
            kwargs.pop("signal", None)
            started.append(kwargs)

    signals.step_started.connect(note, weak=False)
    try:
        wf = durable.workflow("announced")

        @wf.step(retry=2, backoff=30)
        def only():
            if current_run().attempt == 1:
                raise RuntimeError("once")

        run_id = durable.start(wf)
        assert durable.run_message("announced", 0, run_id) == "retrying"
        set_losses(durable, run_id)  # due now
        assert durable.run_message("announced", 0, run_id) == "completed"
    finally:
        signals.step_started.disconnect(note)
    assert started == [
        {"run_id": run_id, "workflow": "announced", "step": "only", "attempt": 1},
        {"run_id": run_id, "workflow": "announced", "step": "only", "attempt": 2},
    ]


def test_step_finished_names_the_run_workflow_step_attempt_status_and_duration(durable):
    finished: list[dict[str, Any]] = []

    def note(sender: Any, **kwargs: Any) -> None:
        if sender is durable:
            kwargs.pop("signal", None)
            finished.append(kwargs)

    signals.step_finished.connect(note, weak=False)
    try:
        wf = durable.workflow("timed")

        @wf.step(retry=2, backoff=30)
        def only():
            time.sleep(0.05)  # a duration to measure
            if current_run().attempt == 1:
                raise RuntimeError("once")

        run_id = durable.start(wf)
        assert durable.run_message("timed", 0, run_id) == "retrying"
        set_losses(durable, run_id)  # due now
        assert durable.run_message("timed", 0, run_id) == "completed"
    finally:
        signals.step_finished.disconnect(note)
    durations = [f.pop("duration") for f in finished]
    assert finished == [
        {"run_id": run_id, "workflow": "timed", "step": "only", "attempt": 1, "status": "failed"},
        {"run_id": run_id, "workflow": "timed", "step": "only", "attempt": 2, "status": "completed"},
    ]
    recorded = durable.list_steps(run_id)
    for duration, step in zip(durations, recorded, strict=True):
        assert 0.05 <= duration == (step.finished_at - step.started_at).total_seconds() < 10
