"""Dashboard fixtures: a Durable on PostgreSQL + Redis with a real worker and a few runs that
show every part of the pages (a held key with re-adds and a dropped input, a failed run with
its traceback and log lines, a finished holder, a key that is an XSS attempt)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
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
