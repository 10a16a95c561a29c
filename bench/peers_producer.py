"""The producer process of one system in ``bench.peers``: starts runs when told, reports timings.

    python -m bench.peers_producer plain|durable|dbos|procrastinate

It reads one JSON command a line on stdin and answers each with one JSON line on stdout (after
``peers-producer ``, so that what a library prints is told apart):

- ``{"op": "burst", "batch": B, "runs": N, "threads": T}``: start N runs from T threads at once;
- ``{"op": "steady", "batch": B, "runs": N, "rate": R, "steps": S}``: start N runs (of S steps, 3
  or 1) from one thread, one every 1/R seconds, each with ``t0 = time.time()`` taken just before
  its start call (``rec`` on);
- ``{"op": "keyed", "prefix": P, "count": N}``: N starts from one thread, each with a key of its
  own (``P-<n>``), on the system's unworked queue; answers the seconds, this process's CPU and
  the p50/p99 of a call;
- ``{"op": "quit"}``.

Each answer carries ``seconds`` (the calls' wall time) and ``cpu`` (this process's, all threads).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any


class Plain:
    """Plain Celery: a chain of three immutable signatures of one task."""

    keyed = None

    def __init__(self) -> None:
        """Load the plain app."""
        from celery import chain

        from bench.peers_plain_app import app

        self.chain, self.app = chain, app

    def start(self, batch: str, i: int, t0: float, rec: int, steps: int = 3) -> None:
        """Send one chain (one task for a one-step run)."""
        if steps == 1:
            self.app.signature("peers.only", args=(batch, i, t0, rec)).apply_async()
            return
        sigs = [
            self.app.signature("peers.step", args=(batch, i, t0, rec, n), immutable=True) for n in (1, 2, 3)
        ]
        self.chain(*sigs).apply_async()


class Durable:
    """durable_celery: ``durable.start``, with ``key=`` for keyed starts."""

    def __init__(self) -> None:
        """Load the durable app (upkeep off in this process)."""
        os.environ["BENCH_PEERS_UPKEEP"] = "0"
        from bench import peers_durable_app

        self.mod = peers_durable_app
        self.published: dict[str, float] = {}

    def start(self, batch: str, i: int, t0: float, rec: int, steps: int = 3) -> str:
        """Start one run; returns its id."""
        workflow = self.mod.run1 if steps == 1 else self.mod.run3
        return self.mod.durable.start(workflow, {"batch": batch, "i": i, "t0": t0, "rec": rec})

    def keyed(self, key: str, i: int) -> None:
        """Start one run with a key."""
        self.mod.durable.start(self.mod.keyed, {"i": i}, key=key)

    def settle(self) -> None:
        """Wait until the background publisher sent what was started."""
        self.mod.durable.flush()

    def _sent(self, body: Any = None, **_: Any) -> None:
        """Note when a step message left (Celery's ``after_task_publish``, in the publisher's thread)."""
        self.published[body[1]["run_id"]] = time.time()

    def trace(self, on: bool) -> None:
        """Note when each message is published (during the latency rounds only)."""
        from celery import signals

        if on:
            self.published = {}
            signals.after_task_publish.connect(self._sent, weak=False)
        else:
            signals.after_task_publish.disconnect(self._sent)


class Dbos:
    """DBOS: ``DBOSClient.enqueue`` on the queue; the key is the workflow ID."""

    def __init__(self) -> None:
        """Make the client."""
        from dbos import DBOSClient

        from bench.peers_dbos_app import KEYED_QUEUE, QUEUE, WORKFLOW, WORKFLOW1

        self.client = DBOSClient(system_database_url=os.environ["BENCH_PEERS_DB"])
        self.options = {"workflow_name": WORKFLOW, "queue_name": QUEUE}
        self.options1 = {"workflow_name": WORKFLOW1, "queue_name": QUEUE}
        self.keyed_options = {"workflow_name": WORKFLOW, "queue_name": KEYED_QUEUE}

    def start(self, batch: str, i: int, t0: float, rec: int, steps: int = 3) -> None:
        """Enqueue one run."""
        self.client.enqueue(self.options1 if steps == 1 else self.options, batch, i, t0, rec)

    def keyed(self, key: str, i: int) -> None:
        """Enqueue one run whose workflow ID is the key."""
        self.client.enqueue({**self.keyed_options, "workflow_id": key}, "keyed", i, 0.0, 0)


class Procrastinate:
    """procrastinate: ``step1.defer``; a key is a ``queueing_lock``."""

    def __init__(self) -> None:
        """Open the app (a synchronous pool)."""
        from bench import peers_procrastinate_app as mod

        mod.app.open()
        self.mod = mod

    def start(self, batch: str, i: int, t0: float, rec: int, steps: int = 3) -> None:
        """Defer the first job of one run."""
        (self.mod.only if steps == 1 else self.mod.step1).defer(batch=batch, i=i, t0=t0, rec=rec)

    def keyed(self, key: str, i: int) -> None:
        """Defer one job with a queueing lock."""
        self.mod.step1.configure(queueing_lock=key, queue=self.mod.KEYED_QUEUE).defer(
            batch="keyed", i=i, t0=0.0, rec=0
        )


PREFIX = "peers-producer "  # our lines on stdout; a library may print others
SYSTEMS = {"plain": Plain, "durable": Durable, "dbos": Dbos, "procrastinate": Procrastinate}


def burst(side: Any, batch: str, runs: int, threads: int) -> dict[str, Any]:
    """Start ``runs`` runs from ``threads`` threads as fast as they go."""

    def part(first: int, count: int) -> None:
        for i in range(first, first + count):
            side.start(batch, i, 0.0, 0)

    shares = [runs // threads + (n < runs % threads) for n in range(threads)]
    firsts = [sum(shares[:n]) for n in range(threads)]
    workers = [threading.Thread(target=part, args=(f, s)) for f, s in zip(firsts, shares, strict=True)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return {}


def steady(side: Any, batch: str, runs: int, rate: float, steps: int = 3) -> dict[str, Any]:
    """Start ``runs`` runs (of ``steps`` steps: 3 or 1) one every ``1/rate`` seconds; returns how
    late the last call began.

    Notes per run, as step ``0``, when its start call returned, and for durable, as step ``-1``,
    when its first step's message was published (the background publisher's send)."""
    from bench.peers_work import record

    if hasattr(side, "trace"):
        side.trace(True)
    began = time.perf_counter()
    late, calls = 0.0, []
    for i in range(runs):
        wait = began + i / rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        else:
            late = max(late, -wait)
        t0 = time.time()
        ident = side.start(batch, i, t0, 1, steps)
        calls.append((i, t0, time.time(), ident))
    if hasattr(side, "trace"):
        side.settle()
        side.trace(False)
    published = getattr(side, "published", {})
    for i, t0, returned, ident in calls:
        record(f"{batch} {i} 0 {t0:.6f} {returned:.6f}\n")
        if ident in published:
            record(f"{batch} {i} -1 {t0:.6f} {published[ident]:.6f}\n")
    return {"late": late}


def keyed(side: Any, prefix: str, count: int) -> dict[str, Any]:
    """``count`` keyed starts from this thread, each timed."""
    times = []
    for i in range(count):
        t = time.perf_counter()
        side.keyed(f"{prefix}-{i}", i)
        times.append(time.perf_counter() - t)
    times.sort()
    return {"p50": times[len(times) // 2], "p99": times[min(len(times) - 1, int(len(times) * 0.99))]}


def serve(side: Any) -> None:
    """Answer commands from stdin until ``quit``."""
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            return
        cpu0, t0 = time.process_time(), time.perf_counter()
        answer = {"burst": burst, "steady": steady, "keyed": keyed}[op](side, **command)
        if hasattr(side, "settle"):
            side.settle()
        answer.update(seconds=time.perf_counter() - t0, cpu=time.process_time() - cpu0)
        print(PREFIX + json.dumps(answer), flush=True)


def main(system: str) -> None:
    """Load one system's producer, say it is ready, then serve."""
    side = SYSTEMS[system]()
    print(PREFIX + json.dumps({"ready": system}), flush=True)
    serve(side)


if __name__ == "__main__":
    main(sys.argv[1])
