"""The chaos workflows and the ledger their steps write to.

Every step execution writes a ``begin`` row to ``chaos_ledger`` when it starts, an ``end`` row
when its body is done and a ``done`` row once the library has finished with it (its outcome
recorded, fenced, or its task over), on a connection of its own (autocommit, outside the
library's transactions), with the run, step, attempt, fencing token, process, thread and worker.
So the ledger counts executions, including the ones the library never records (a killed
process, a fenced worker), and tells when each was in progress; the checks compare it with
``durable_steps``.

Workflows (three steps each; each step sleeps ``ms[i]`` milliseconds):

| workflow | started | leads to |
|---|---|---|
| ``chain`` | without a key | ``completed`` |
| ``doomed`` | without a key; its last step always raises ``Doomed`` (2 attempts) | ``failed`` |
| ``keyed`` | with a key, any ``on_duplicate`` | ``completed``, or ``cancelled`` when replaced |

``define`` also defines the atomic scenario's ``ledger_atomic`` and ``ledger_plain``
(``atomic_workflows.py``).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from celery import Celery
from celery.signals import task_postrun

from durable_celery import Durable, current_run, signals

# Settings of every chaos worker: short timeouts so a lost node is swept within seconds.
SETTINGS: dict[str, Any] = {
    "poll_interval": 0.2,
    "heartbeat_interval": 0.4,
    "stale_lock_timeout": 4.0,  # 10 x heartbeat_interval: a busy 2-core machine never misses that
    "sweep_interval": 0.5,
    "relay_after": 3.0,
    "backoff_base": 0.2,
    "backoff_max": 2.0,
    "shutdown_grace_period": 1.0,
    "max_losses": 5,  # a run unlucky enough to be lost 3 times in one step is not the point here
    "pool_size": 3,
}
STEPS = ("fetch", "transform", "store")
RETRY = 8  # a killed pool process uses an attempt; eight is far more than any run meets
DOOMED_RETRY = 2

LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS chaos_ledger (
    id bigserial PRIMARY KEY,
    run_id text NOT NULL,
    workflow text NOT NULL,
    step int NOT NULL,
    attempt int NOT NULL,
    fence int NOT NULL,
    pid int NOT NULL,
    thread bigint NOT NULL,
    worker text NOT NULL,
    phase text NOT NULL,
    at double precision NOT NULL
);
CREATE INDEX IF NOT EXISTS chaos_ledger_run ON chaos_ledger (run_id);
"""
_INSERT = (
    "INSERT INTO chaos_ledger (run_id, workflow, step, attempt, fence, pid, thread, worker, phase, at) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)


class Doomed(Exception):
    """What the last step of ``doomed`` always raises."""


class Ledger:
    """Writes ledger rows on a connection per process and thread; waits out a database outage."""

    def __init__(self, url: str, worker: str, patience: float = 180.0) -> None:
        self.url, self.worker, self.patience = url, worker, patience
        self._local = threading.local()

    def _connection(self) -> psycopg.Connection[Any]:
        held = getattr(self._local, "held", None)
        if held is not None and held[0] == os.getpid():  # a forked pool process makes its own
            return held[1]
        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=3)
        self._local.held = (os.getpid(), conn)
        return conn

    def _drop(self) -> None:
        held = getattr(self._local, "held", None)
        self._local.held = None
        if held is not None and held[0] == os.getpid():
            with contextlib.suppress(Exception):  # a broken connection may fail to close too
                held[1].close()

    def write(self, phase: str, step: int) -> None:
        """One row for the current run's execution of ``step`` (a ``begin`` opens it in this thread)."""
        run = current_run()
        active = getattr(run, "_active", None)  # the fencing token this execution claimed with
        execution = (run.id, run.workflow, step, run.attempt, int(getattr(active, "fence", -1)))
        if phase == "begin":
            self._open().append(execution)
        self._insert((*execution, os.getpid(), threading.get_ident(), self.worker, phase, time.time()))

    def _open(self) -> list[tuple[Any, ...]]:
        """This thread's executions begun and not yet done."""
        if getattr(self._local, "open", None) is None:
            self._local.open = []
        return self._local.open

    def done(self, run_id: str | None = None) -> None:
        """A ``done`` row for this thread's open executions (of ``run_id``, or all): the library
        has recorded or dropped their outcome, or their task is over."""
        now = time.time()
        for execution in [e for e in self._open() if run_id is None or e[0] == run_id]:
            self._open().remove(execution)
            self._insert((*execution, os.getpid(), threading.get_ident(), self.worker, "done", now))

    def connect(self) -> None:
        """Write ``done`` rows when a step's outcome is recorded or fenced and when a task ends."""
        signals.step_finished.connect(lambda sender, run_id, **kw: self.done(run_id), weak=False)
        signals.worker_fenced.connect(lambda sender, run_id, **kw: self.done(run_id), weak=False)
        task_postrun.connect(lambda *args, **kw: self.done(), weak=False)

    def _insert(self, row: tuple[Any, ...]) -> None:
        deadline = time.monotonic() + self.patience
        while True:
            try:
                self._connection().execute(_INSERT, row)
                return
            except (psycopg.OperationalError, psycopg.InterfaceError):  # the database restarts: wait for it
                self._drop()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
            except BaseException:  # stopped mid-write (fenced, cancelled): the connection is unsure
                self._drop()
                raise


def _step_body(ledger: Ledger | None, index: int, raises: bool) -> Callable[..., Any]:
    def body(tag: str, ms: list[int]) -> Any:
        if ledger is not None:
            ledger.write("begin", index)
        time.sleep(ms[index] / 1000)
        if ledger is not None:
            ledger.write("end", index)
        if raises:
            raise Doomed(f"{tag} fails at its last step, as it always does")
        return tag

    body.__name__ = STEPS[index]
    return body


def define(durable: Durable, ledger: Ledger | None = None) -> None:
    """Define the three workflows on ``durable``; a producer passes no ledger (it runs no step)."""
    chain = durable.workflow("chain")
    doomed = durable.workflow("doomed")
    keyed = durable.workflow("keyed", reuse="after_close", on_duplicate="use_existing")
    for index, name in enumerate(STEPS):
        chain.step(_step_body(ledger, index, False), name=name, retry=RETRY)
        keyed.step(_step_body(ledger, index, False), name=name, retry=RETRY)
        last = index == len(STEPS) - 1
        doomed.step(_step_body(ledger, index, last), name=name, retry=DOOMED_RETRY if last else RETRY)
    from tests.chaos.atomic_workflows import define_ledger  # here, not above: it imports this module

    define_ledger(durable, ledger)  # the atomic scenario's (tests/chaos/atomic.py)


def make_producer(broker: str, url: str, queue: str, settings: dict[str, Any], name: str) -> Durable:
    """A producer-side ``Durable``: the workflows defined, no upkeep, no worker."""
    app = Celery(name, broker=broker)
    app.conf.task_default_queue = queue
    client = Durable(app, url, upkeep=False, **settings)
    define(client)
    return client


def step_times(rng: random.Random, long_share: float = 0.05) -> list[int]:
    """Milliseconds for the three steps: mostly short, some medium, a few longer than the
    shutdown grace period (so a SIGTERM or a SIGSTOP finds steps mid-way)."""
    times = []
    for _ in STEPS:
        roll = rng.random()
        if roll < long_share:
            times.append(2500)
        elif roll < long_share + 0.15:
            times.append(rng.randint(400, 800))
        else:
            times.append(rng.randint(50, 250))
    return times


def new_input(rng: random.Random, long_share: float = 0.05) -> dict[str, Any]:
    """A run's input: a tag that names this one start, and its step times."""
    return {"tag": uuid.uuid4().hex, "ms": step_times(rng, long_share)}


EXPECTED = {"chain": ("completed",), "doomed": ("failed",), "keyed": ("completed", "cancelled")}
