"""Durable, keyed workflows for Celery, with PostgreSQL as the source of truth."""

from .app import Durable, durable_workflow
from .capabilities import Capability
from .core.context import RunContext, current_run
from .definition import SendEvent, Step, Workflow
from .errors import (
    ChildFailed,
    DatabaseUnavailable,
    DurableError,
    EventTimeout,
    InvalidArgument,
    InvalidDefinition,
    InvalidKey,
    InvalidStart,
    KeyContended,
    KeyTaken,
    NoKey,
    NotConfigured,
    NotFinished,
    RateLimited,
    ResultTimeout,
    RunCancelled,
    RunFailed,
    RunNotFound,
    RunStopped,
    ScheduleNotFound,
    StepTimeout,
    UnknownWorkflow,
    Unsupported,
    WorkerLost,
)
from .models import Run, StepRecord
from .schedules import Schedule

__version__ = "0.1.0"

__all__ = [
    "Durable",
    "Capability",
    "durable_workflow",
    "current_run",
    "RunContext",
    "SendEvent",
    "Step",
    "Workflow",
    "Run",
    "StepRecord",
    "Schedule",
    "DurableError",
    "EventTimeout",
    "ChildFailed",
    "DatabaseUnavailable",
    "InvalidArgument",
    "InvalidDefinition",
    "InvalidKey",
    "InvalidStart",
    "KeyContended",
    "KeyTaken",
    "NoKey",
    "NotConfigured",
    "NotFinished",
    "RateLimited",
    "ResultTimeout",
    "RunCancelled",
    "RunFailed",
    "RunNotFound",
    "RunStopped",
    "ScheduleNotFound",
    "StepTimeout",
    "UnknownWorkflow",
    "Unsupported",
    "WorkerLost",
]
