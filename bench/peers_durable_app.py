"""The durable side of ``bench.peers``: a workflow of three steps, one of one step, and one for
keyed starts.

Run by ``celery -A bench.peers_durable_app worker -P prefork -c 2 -Q peers_durable`` with the
defaults (inline continuation on, upkeep on, background publishing); the producer imports it
and calls ``durable.start`` (``upkeep`` off there: ``BENCH_PEERS_UPKEEP=0``). ``peers_keyed``
lives on a queue no worker reads: keyed starts are timed without their runs being worked.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from celery import Celery, signals

from bench import peers_work
from durable_celery import Durable

QUEUE = "peers_durable"
KEYED_QUEUE = "peers_keyed"

app = Celery("bench_peers_durable", broker=os.environ["BENCH_PEERS_REDIS"], set_as_current=False)
app.conf.update(
    task_serializer="json",
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    worker_hijack_root_logger=False,
)
durable = Durable(app, os.environ["BENCH_PEERS_DB"], upkeep=os.environ.get("BENCH_PEERS_UPKEEP", "1") == "1")


def _step(n: int, batch: str, i: int, t0: float, rec: int) -> None:
    """Step ``n`` of a durable run."""
    peers_work.step(batch, i, t0, rec, n)


def _only(batch: str, i: int, t0: float, rec: int) -> None:
    """The step of a one-step durable run."""
    peers_work.only(batch, i, t0, rec)


def _nothing(**_: Any) -> None:
    """The one step of a keyed run (never worked in the bench)."""


run3 = durable.workflow("peers_run3")
for _n in (1, 2, 3):
    run3.step(partial(_step, _n), name=f"s{_n}")

run1 = durable.workflow("peers_run1")
run1.step(_only, name="only")

keyed = durable.workflow("peers_keyed", queue=KEYED_QUEUE)
keyed.step(_nothing, name="only")


signals.task_prerun.connect(peers_work.task_began, weak=False)


@signals.worker_ready.connect
def _ready(**_: object) -> None:
    """Tell the bench this worker is up."""
    peers_work.ready("durable")
