"""The plain Celery side of ``bench.peers``: one task, chained three times per run (a one-step
run is one task of its own).

Run by ``celery -A bench.peers_plain_app worker -P prefork -c 2 -Q peers_plain``; the producer
imports it for the app and sends ``chain(step(.., 1), step(.., 2), step(.., 3))`` of immutable
signatures. Nothing of durable_celery is loaded here, so the worker is Celery alone.
"""

from __future__ import annotations

import os

from celery import Celery, signals

from bench import peers_work

QUEUE = "peers_plain"

app = Celery("bench_peers_plain", broker=os.environ["BENCH_PEERS_REDIS"], set_as_current=False)
app.conf.update(
    task_serializer="json",
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    task_default_routing_key=QUEUE,
    worker_hijack_root_logger=False,
)


@app.task(name="peers.step", ignore_result=True, acks_late=True)
def step(batch: str, i: int, t0: float, rec: int, n: int) -> None:
    """One step of a plain run."""
    peers_work.step(batch, i, t0, rec, n)


@app.task(name="peers.only", ignore_result=True, acks_late=True)
def only(batch: str, i: int, t0: float, rec: int) -> None:
    """The task of a one-step run."""
    peers_work.only(batch, i, t0, rec)


signals.task_prerun.connect(peers_work.task_began, weak=False)


@signals.worker_ready.connect
def _ready(**_: object) -> None:
    """Tell the bench this worker is up."""
    peers_work.ready("plain")
