"""``StepTasks``: each step of a workflow becomes a Celery task whose body hands the message to
the engine (``Engine.run_message``) and gives the task the state the attempt came to; and
``UnknownSteps``, which answers a step message whose task this code lacks (rollout.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery import signals as celery_signals

from ..core.engine import Engine
from ..core.rollout import PREFIX, handle_unknown_step
from ..core.runs import backoff
from ..definition import Step, Workflow
from . import task_states

if TYPE_CHECKING:
    from ..core.runtime import Runtime

log = logging.getLogger("durable_celery")


class StepTasks:
    """Makes the Celery task of every step of one Durable's workflows (the registry's ``on_step``)."""

    def __init__(self, app: Any, engine: Engine) -> None:
        self.app = app
        self.engine = engine
        # Called after a step's task is registered (testing.worker: a worker already running in
        # this process learns tasks defined after it started).
        self.on_new_task: list[Callable[[], None]] = []

    def add(self, workflow: Workflow, step: Step) -> None:
        """Register the Celery task of ``step`` (``durable.<workflow>.<step>``)."""
        engine, registry, settings = self.engine, self.engine.rt.registry, self.engine.rt.settings
        workflow_name, index = workflow.name, step.index

        def run_step(
            task: Any, run_id: str, step: int = index, attempt: int = 1, phase: str = "step"
        ) -> task_states.StepSummary:
            # The task's Celery state tells what the attempt came to (task_states.py).
            compensate = phase == "compensate"
            wf = registry.workflows[workflow_name or ""]
            queue = (task.request.delivery_info or {}).get("routing_key")
            events = task_states.InlineEvents(task) if engine.task_events.value else None
            result = engine.run_message(wf, wf.steps[index], run_id, compensate, queue, events)
            return task_states.task_result(
                result,
                task.request,
                run_id,
                wf,
                wf.steps[index],
                compensate,
                lambda s, attempt: backoff(settings, s, attempt),
            )

        run_step.__name__ = step.name
        run_step.__doc__ = f"Durable step {step.name!r} of workflow {workflow_name!r}."
        self.app.task(
            name=step.task_name,
            bind=True,
            shared=False,
            acks_late=True,
            acks_on_failure_or_timeout=True,  # a failed step is recorded: never leave its message
            ignore_result=True,
            serializer="json",
            typing=False,
            # Records a pool process that dies mid-step, and announces ignored messages.
            Request=f"{task_states.__name__}:StateRequest",
            durable_workflow=workflow_name,
            durable_step=index,
            durable_engine=engine,  # for the request that records a lost pool process (lost.py)
        )(run_step)
        for hook in list(self.on_new_task):
            hook()


class UnknownSteps:
    """Answers unknown durable step messages for one Durable; held by it, so the signal's weak
    reference lets a discarded Durable go."""

    def __init__(self, rt: Runtime, app: Any) -> None:
        self.rt = rt
        self.app = app

    def on_unknown(self, sender: Any = None, message: Any = None, name: str = "", **_: Any) -> None:
        """Hand an unknown step message of this app back to its run (``task_unknown``)."""
        if getattr(sender, "app", None) is not self.app or not name.startswith(PREFIX):
            return
        try:
            body = message.decode() if message is not None else None
            kwargs = body[1] if isinstance(body, (list, tuple)) and len(body) > 1 else {}
            handle_unknown_step(self.rt, name, kwargs if isinstance(kwargs, dict) else {})
        except Exception:  # never let this break the consumer; the relay sends it again later
            log.exception("durable: could not hand back unknown step message %s", name)


def answer_unknown_steps(rt: Runtime, app: Any) -> UnknownSteps:
    """Answer unknown durable step messages that reach this app's workers (the Durable keeps
    the handler returned: the signal holds it weakly)."""
    handler = UnknownSteps(rt, app)
    celery_signals.task_unknown.connect(handler.on_unknown)
    return handler
