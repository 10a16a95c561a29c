"""The DBOS side of ``bench.peers``: a workflow of three steps on a queue, and its workers.

A run is ``peers_run(batch, i, t0, rec)``, a ``@DBOS.workflow`` calling three ``@DBOS.step``
functions (each checkpointed); a one-step run is ``peers_run1``. The producer enqueues it with
``DBOSClient.enqueue`` on the queue ``peers`` (a keyed start gives the key as the workflow ID,
on ``peers_keyed``, which no worker reads). A worker process is ``serve(index)``: DBOS launched
in the process, listening to ``peers`` only, with ``worker_concurrency`` workflows at a time and
the queue polled every ``BENCH_PEERS_DBOS_POLL`` seconds (the bench's ``--dbos-poll``; DBOS's
own default is 1 s).
"""

from __future__ import annotations

import os
import signal
import threading

from dbos import DBOS

from bench import peers_work

QUEUE = "peers"
KEYED_QUEUE = "peers_keyed"
WORKFLOW = "peers_run"
WORKFLOW1 = "peers_run1"


@DBOS.step(name="peers_step")
def step(batch: str, i: int, t0: float, rec: int, n: int) -> None:
    """One step of a DBOS run."""
    peers_work.step(batch, i, t0, rec, n)


@DBOS.workflow(name=WORKFLOW)
def peers_run(batch: str, i: int, t0: float, rec: int) -> None:
    """A run: three steps in turn."""
    for n in (1, 2, 3):
        step(batch, i, t0, rec, n)


@DBOS.step(name="peers_only")
def only_step(batch: str, i: int, t0: float, rec: int) -> None:
    """The step of a one-step DBOS run."""
    peers_work.only(batch, i, t0, rec)


@DBOS.workflow(name=WORKFLOW1)
def peers_run1(batch: str, i: int, t0: float, rec: int) -> None:
    """A one-step run."""
    only_step(batch, i, t0, rec)


def serve(index: int, concurrency: int) -> None:
    """Run one DBOS worker process until SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    DBOS(
        config={
            "name": "bench_peers",
            "system_database_url": os.environ["BENCH_PEERS_DB"],
            "log_level": "WARNING",
            "executor_id": f"peers-worker-{index}",
        }
    )
    DBOS.listen_queues([QUEUE])
    DBOS.launch()
    poll = float(os.environ.get("BENCH_PEERS_DBOS_POLL", "0.1"))
    DBOS.register_queue(
        QUEUE, polling_interval_sec=poll, worker_concurrency=concurrency, on_conflict="always_update"
    )
    peers_work.ready("dbos")
    stop.wait()
    DBOS.destroy()
