"""Lifecycle signals of durable runs, as Celery ``Signal`` objects.

Connect as with any Celery signal:

    from durable_celery import signals

    @signals.run_finished.connect
    def on_finished(sender, run_id, workflow, status, **kw): ...

``sender`` is the ``Durable`` instance.
"""

from celery.utils.dispatch import Signal

run_started = Signal(name="durable_run_started", providing_args={"run_id", "workflow", "key"})
run_finished = Signal(name="durable_run_finished", providing_args={"run_id", "workflow", "status"})
step_started = Signal(name="durable_step_started", providing_args={"run_id", "workflow", "step", "attempt"})
step_finished = Signal(
    name="durable_step_finished",
    providing_args={"run_id", "workflow", "step", "attempt", "status", "duration"},
)
worker_fenced = Signal(name="durable_worker_fenced", providing_args={"run_id", "workflow", "step"})
stale_recovered = Signal(name="durable_stale_recovered", providing_args={"run_ids"})
key_duplicate = Signal(name="durable_key_duplicate", providing_args={"run_id", "workflow", "key", "outcome"})
key_handoff = Signal(name="durable_key_handoff", providing_args={"run_id", "workflow", "key", "previous_id"})
key_release = Signal(name="durable_key_release", providing_args={"run_id", "workflow", "key", "by"})
# A worker begins its graceful shutdown (SIGTERM, durable.drain(), celery control shutdown):
# sent in the worker's main process, before its running steps get their grace period.
worker_draining = Signal(name="durable_worker_draining", providing_args={"node", "grace"})

__all__ = [
    "run_started",
    "run_finished",
    "step_started",
    "step_finished",
    "worker_fenced",
    "stale_recovered",
    "key_duplicate",
    "key_handoff",
    "key_release",
    "worker_draining",
]
