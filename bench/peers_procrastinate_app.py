"""The procrastinate side of ``bench.peers``: a run is three jobs, each deferring the next.

``step1`` is deferred by the producer (with ``queueing_lock=key`` for a keyed start, on
``peers_keyed``, which no worker reads); it defers ``step2``, which defers ``step3``. A one-step
run is ``only``. Tasks are ``async`` (a defer from a task is then an ``await`` on the worker's
pool, as procrastinate advises for I/O-bound tasks). A worker process is ``serve(index,
concurrency)``: ``app.run_worker`` on the queue ``peers`` (LISTEN/NOTIFY on, the default).
"""

from __future__ import annotations

import os

import procrastinate

from bench import peers_work

QUEUE = "peers"
KEYED_QUEUE = "peers_keyed"

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=os.environ["BENCH_PEERS_DB"]),
    import_paths=["bench.peers_procrastinate_app"],
)


@app.task(name="peers.step3", queue=QUEUE)
async def step3(batch: str, i: int, t0: float, rec: int) -> None:
    """The last step of a run."""
    peers_work.step(batch, i, t0, rec, 3)


@app.task(name="peers.step2", queue=QUEUE)
async def step2(batch: str, i: int, t0: float, rec: int) -> None:
    """The second step: then defers the third."""
    peers_work.step(batch, i, t0, rec, 2)
    await step3.defer_async(batch=batch, i=i, t0=t0, rec=rec)


@app.task(name="peers.step1", queue=QUEUE)
async def step1(batch: str, i: int, t0: float, rec: int) -> None:
    """The first step: then defers the second."""
    peers_work.step(batch, i, t0, rec, 1)
    await step2.defer_async(batch=batch, i=i, t0=t0, rec=rec)


@app.task(name="peers.only", queue=QUEUE)
async def only(batch: str, i: int, t0: float, rec: int) -> None:
    """The job of a one-step run."""
    peers_work.only(batch, i, t0, rec)


def serve(index: int, concurrency: int) -> None:
    """Run one procrastinate worker process until SIGTERM (its own signal handling)."""
    peers_work.ready("procrastinate")
    app.run_worker(queues=[QUEUE], concurrency=concurrency, name=f"peers-worker-{index}")
