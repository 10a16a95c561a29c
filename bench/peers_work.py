"""What every system's steps do in ``bench.peers``: note when they began, count finished runs.

Each step of every system calls ``step(batch, i, t0, rec, n)`` first thing. With ``rec`` (the
latency rounds) it appends ``batch i n t0 now`` to a file of its own process under
``BENCH_PEERS_DIR`` (one ``write`` of a line, ``O_APPEND``), so the bench reads, per run, when
it was started (``t0``, taken by the producer just before its start call) and when each of its
three steps began, all from one machine's clock. Step 1's line also says when the task that ran
it began in its worker process (Celery's ``task_prerun``, for the two Celery systems): from
there to the step's body is what the worker does before a step (durable: its claim). The third
step counts its run done with one ``INCR`` on the bench's Redis (``BENCH_PEERS_REDIS``),
whatever the system: the same small cost for all four, and how the bench sees that a batch
finished without polling anyone's tables.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

_state: dict[str, Any] = {"pid": None, "fd": None, "redis": None, "began": None}


def _mine() -> dict[str, Any]:
    """This process's file and Redis client (made anew after a fork)."""
    if _state["pid"] != os.getpid():
        _state.update(pid=os.getpid(), fd=None, redis=None, began=None)
    return _state


def record(line: str) -> None:
    """Append one line to this process's file of step times."""
    state = _mine()
    if state["fd"] is None:
        path = os.path.join(os.environ["BENCH_PEERS_DIR"], f"steps-{os.getpid()}.log")
        state["fd"] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(state["fd"], line.encode())


def done(batch: str) -> None:
    """Count one run of ``batch`` finished."""
    state = _mine()
    if state["redis"] is None:
        state["redis"] = redis.Redis.from_url(os.environ["BENCH_PEERS_REDIS"])
    state["redis"].incr(f"peers:done:{batch}")


def task_began(**_: Any) -> None:
    """Celery's ``task_prerun``: note when this process began a task."""
    _mine()["began"] = time.time()


def step(batch: str, i: int, t0: float, rec: int, n: int) -> None:
    """Step ``n`` (1 to 3) of run ``i``: note its start when recording, count the run after the third."""
    now = time.time()
    if rec:
        began = _mine()["began"] if n == 1 else None
        record(f"{batch} {i} {n} {t0:.6f} {now:.6f}" + ("\n" if began is None else f" {began:.6f}\n"))
    if n == 3:
        done(batch)


def only(batch: str, i: int, t0: float, rec: int) -> None:
    """The one step of a one-step run (the latency rounds at a high rate): step 1, then counted."""
    step(batch, i, t0, rec, 1)
    done(batch)


def ready(name: str) -> None:
    """Tell the bench that a worker process of ``name`` is up."""
    client = redis.Redis.from_url(os.environ["BENCH_PEERS_REDIS"])
    try:
        client.incr(f"peers:ready:{name}")
    finally:
        client.close()
