"""A run is born here: its id and its first row; and how long a failed attempt waits."""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

from ..definition import Step, Workflow
from ..settings import Settings
from ..store.db import Clock
from .queues import queue_of

_ids = threading.Lock()
_last_id = (0, 0)  # (milliseconds, the 74 random bits) of this process's newest id
_RANDOM = 1 << 74


def new_run_id() -> str:
    """A new run id: a time-ordered UUID (RFC 9562 version 7) as text, growing within a process.

    Ids that grow with time put new runs at the right edge of the primary key's index, where its
    pages stay cached: starts and claims of recent runs do not slow down as history grows. Ids made
    in the same millisecond by one process follow each other (the random part counts up, RFC 9562
    "monotonic random"), so runs started at the same recorded time keep their start order.
    """
    make = getattr(uuid, "uuid7", None)  # Python 3.14+ (monotonic within a process too)
    if make is not None:
        return str(make())
    global _last_id
    with _ids:
        millis = time.time_ns() // 1_000_000
        rand = int.from_bytes(os.urandom(10), "big") >> 6  # 74 bits
        last_millis, last_rand = _last_id
        if millis <= last_millis:
            millis, rand = last_millis, last_rand + 1
            if rand >= _RANDOM:
                millis, rand = millis + 1, 0
        _last_id = (millis, rand)
    value = (millis & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | (rand >> 62) << 64 | 0b10 << 62
    value |= rand & 0x3FFF_FFFF_FFFF_FFFF
    return str(uuid.UUID(int=value))


def new_run(
    default_queue: str,
    wf: Workflow,
    data: dict[str, Any],
    key: str | None,
    tags: dict[str, str] | None = None,
    priority: int | None = None,
    aging: float = 60.0,
    batch_key: str | None = None,
) -> dict[str, Any]:
    """A new run's row; InvalidStart if a step cannot take ``data`` (every path that makes
    a run comes here before it writes: start, rerun, fork, children, schedule fires).

    ``priority`` (the workflow's when None) places the run in the line of its flow limits:
    ``line_at`` is its start time less ``priority * aging`` seconds, so a higher priority goes
    ahead of runs started up to that long before it, never of older ones (no run starves).

    A batch workflow's input is ``{"items": [...]}``, its flow keys those of the first item;
    with ``batch_key`` the run gathers starts (core/batches.py), due once its period is over."""
    wf.check_fits(data)
    rank = wf.priority if priority is None else priority
    run: dict[str, Any] = {
        "id": new_run_id(),
        "workflow": wf.name,
        "status": "pending",
        "step_name": wf.steps[0].name if wf.steps else None,
        "input": data,
        "context": {},
        "key": key,
        "created_at": Clock(),
        "line_at": Clock(-rank * aging),
        "due_at": Clock(),
        "published": True,
        "queue": queue_of(default_queue, wf, 0),
    }
    items = data.get("items") if wf.batch is not None else None
    keyed_by = items[0] if isinstance(items, list) and items and isinstance(items[0], dict) else data
    run.update((column, value) for column, value in wf.flow_keys(keyed_by).items() if value is not None)
    if tags:
        run["tags"] = tags
    if rank:
        run["priority"] = rank
    if batch_key is not None:
        run.update(batch_key=batch_key, due_at=Clock(wf.batch.period), published=False)
    elif wf.timeout and not (wf.debounce and key is not None):
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
