"""A run is born here: its id and its first row; and how long a failed attempt waits."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from ..definition import Step, Workflow
from ..settings import Settings
from ..store.db import Clock
from .queues import queue_of


def new_run_id() -> str:
    """A new run id: a time-ordered UUID (RFC 9562 version 7) as text.

    Ids that grow with time put new runs at the right edge of the primary key's index, where its
    pages stay cached: starts and claims of recent runs do not slow down as history grows.
    """
    make = getattr(uuid, "uuid7", None)  # Python 3.14+
    if make is not None:
        return str(make())
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits; 74 are used
    value = (millis & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | (rand >> 68) << 64 | 0b10 << 62
    value |= rand & 0x3FFF_FFFF_FFFF_FFFF
    return str(uuid.UUID(int=value))


def new_run(default_queue: str, wf: Workflow, data: dict[str, Any], key: str | None) -> dict[str, Any]:
    """A new run's row; InvalidStart if a step cannot take ``data`` (every path that makes
    a run comes here before it writes: start, rerun, children, schedule fires)."""
    wf.check_fits(data)
    run = {
        "id": new_run_id(),
        "workflow": wf.name,
        "status": "pending",
        "step_name": wf.steps[0].name if wf.steps else None,
        "input": data,
        "context": {},
        "key": key,
        "created_at": Clock(),
        "due_at": Clock(),
        "published": True,
        "queue": queue_of(default_queue, wf, 0),
    }
    if wf.timeout and not (wf.debounce and key is not None):
        run["deadline_at"] = Clock(wf.timeout)
    if wf.debounce and key is not None:
        # Due after the period, never later than the timeout from this first start.
        run.update(due_at=Clock(wf.debounce["period"]), published=False)
        if wf.debounce.get("timeout"):
            run["not_after"] = Clock(wf.debounce["timeout"])
    return run


def backoff(settings: Settings, step: Step, attempt: int) -> float:
    """Seconds to wait before attempt ``attempt + 1`` of ``step``."""
    base = step.backoff or settings.backoff_base
    return float(min(base * 2 ** (attempt - 1), settings.backoff_max))
