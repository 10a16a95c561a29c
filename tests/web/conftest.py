"""Dashboard fixtures: a Durable on PostgreSQL + Redis with a real worker and a few runs that
show every part of the pages (a held key with re-adds and a dropped input, a failed run with
its traceback and log lines, a finished holder, a key that is an XSS attempt)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from durable_celery import Durable, current_run
from durable_celery.testing import wait_for, worker

XSS = "<script>alert(1)</script>"
TOKEN = "s3cret-token"


@pytest.fixture
def backend() -> str:
    """The dashboard is tested on PostgreSQL (with Redis and a real worker) only."""
    return "postgres"


@dataclass
class Scene:
    durable: Durable
    held: str  # invoice:42, waiting for an event, re-added twice (once with a changed input)
    xss: str  # a run whose key, input and error are script tags
    failed: str  # flaky: failed with a traceback and a captured warning
    finished: str  # quick: completed, holds its key under after_close (free to take)
    queue: str


def _define(d: Durable) -> None:
    invoice = d.workflow("invoice", reuse="after_close")

    @invoice.step
    def approve(amount: int, currency: str = "EUR", note: str | None = None) -> Any:
        return current_run().wait_for_event("approve")

    flaky = d.workflow("flaky")

    @flaky.step
    def explode(why: str) -> None:
        logging.getLogger("flaky").warning("about to fail: %s", why)
        raise RuntimeError(f"boom {why}")

    approval = d.workflow("approval")

    @approval.step
    def ask(item: str) -> Any:
        return {"item": item, "answer": current_run().wait_for_input("decision")}

    sync = d.workflow("sync", on_duplicate="run_again")

    @sync.step
    def pull(account: int, since: str = "") -> Any:
        return current_run().wait_for_event("go")

    quick = d.workflow("quick", reuse="after_close")

    @quick.step
    def done(n: int) -> int:
        return n * 2

    # Flow limits shown on the Flow page and the workflow's options (no run of it).
    quota = d.workflow(
        "quota",
        concurrency={"limit": 2, "key": "tenant:{tenant}"},
        throttle={"limit": 10, "period": 60, "key": "api:{customer}"},
        rate_limit={"limit": 1, "period": 3600},
    )
    quota.step(lambda tenant, customer: None, name="call")

    _define_stuck(d)


def _define_stuck(d: Durable) -> None:
    """The workflows of the runs that do not move, each for its own reason (see stuck_runs)."""
    payment = d.workflow("payment")

    @payment.step(retry=3, backoff=600)
    def charge(card: str) -> None:
        raise RuntimeError(f"card {card} declined")

    autosave = d.workflow("autosave", debounce={"period": 600, "timeout": 3600})

    @autosave.step
    def save(doc: str) -> str:
        return doc

    report = d.workflow("report", queue=nobody_queue(d))

    @report.step
    def render(month: str) -> str:
        return month

    trip = d.workflow("trip")

    def unbook(city: str) -> None:
        raise RuntimeError(f"hotel in {city} refuses the refund")

    @trip.step(compensate=unbook, compensate_retry=1)
    def book(city: str) -> str:
        return city

    @trip.step
    def pay(city: str) -> None:
        raise RuntimeError("payment refused")


def nobody_queue(d: Durable) -> str:
    """A queue of this test's own that no worker consumes."""
    return f"{d.app.conf.task_default_queue}-nobody"


def until(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll ``check`` until it returns something true; TimeoutError naming ``what`` if not."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout}s")
        time.sleep(0.05)
    return found


@dataclass
class Stuck:
    retrying: str  # payment: attempt 1 failed, attempt 2 due in 300 s (backoff_max)
    debounced: str  # autosave: due in 600 s, at the latest in 3600 s
    no_consumer: str  # report: ready on a queue no worker consumes
    compensation_failed: str  # trip: pay failed, the compensation of book failed
    queue: str  # the queue nobody consumes


def stuck_runs(scene: Scene) -> Stuck:
    """Start a run that waits out a retry backoff, a debounced one, one on a queue no worker
    consumes and one whose compensation failed; return once each is in that state."""
    d = scene.durable
    retrying = d.start("payment", {"card": "4242"})
    debounced = d.start("autosave", {"doc": "notes"}, key="doc:notes")
    no_consumer = d.start("report", {"month": "2026-01"})
    compensation_failed = d.start("trip", {"city": "Oslo"})
    until("the first attempt's failure", lambda: [s for s in d.list_steps(retrying) if s.status == "failed"])
    assert wait_for(d, compensation_failed).status == "compensation_failed"
    return Stuck(retrying, debounced, no_consumer, compensation_failed, nobody_queue(d))


@pytest.fixture
def scene(make_durable: Any) -> Iterator[Scene]:
    """The runs every dashboard test looks at, with the worker still running."""
    d = make_durable("web", prune={"completed": "30d"})
    _define(d)
    d.app.conf.beat_schedule = {
        "quick-every-5": d.beat_entry("quick", "*/5 * * * *", key="quick:cron", input={"n": 1})
    }
    with worker(d):
        held = d.start("invoice", {"amount": 10, "currency": "EUR"}, key="invoice:42")
        wait_for(d, held, statuses=("waiting",))
        assert d.start("invoice", {"amount": 10, "currency": "EUR"}, key="invoice:42") == held
        assert d.start("invoice", {"amount": 12, "currency": "EUR", "note": "rush"}, key="invoice:42") == held
        xss = d.start("flaky", {"why": XSS}, key=XSS)
        failed = d.start("flaky", {"why": "disk full"})
        finished = d.start("quick", {"n": 21}, key="quick:1")
        for run_id in (xss, failed, finished):
            wait_for(d, run_id)
        yield Scene(d, held, xss, failed, finished, d.app.conf.task_default_queue)
