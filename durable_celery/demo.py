"""``python -m durable_celery demo``: the shop example on the embedded default, with no servers.

It runs the workflows of ``durable_celery.demo_shop`` (``examples/shop.py`` in a checkout) in a
fresh temporary directory (a SQLite file and the serverless ``durablefs://`` broker), with a real
Celery worker in this process, and prints what became of every run. It needs nothing but the
installed package, and works from any folder. The output names no ids, times or durations, so it
is the same on every machine and a test compares it whole.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import click

from .app import Durable
from .models import Run, StepRecord
from .testing import wait_for, worker

Echo = Callable[[str], None]
SERVER_VARIABLES = ("DURABLE_DATABASE_URL", "CELERY_BROKER_URL", "SHOP_BROKER_URL")


@dataclass(frozen=True)
class DemoRun:
    """One run the demo starts: what to call it, what to start, whether to cancel it, and
    whether to start it again with the same key (before and after it runs)."""

    title: str
    workflow: str
    input: dict[str, Any]
    cancel_first: bool = False
    start_again: bool = False
    expected_error: str | None = None  # the failure this story shows: no traceback logged for it


DEMO_RUNS = (
    DemoRun(
        "place_order A-1001: 2 x mug, paid with a good card",
        "place_order",
        {"order_id": "A-1001", "sku": "mug", "quantity": 2, "payment_token": "tok_visa"},
    ),
    DemoRun(
        "place_order A-1002: 1 x tee, the payment gateway times out once",
        "place_order",
        {"order_id": "A-1002", "sku": "tee", "quantity": 1, "payment_token": "tok_flaky"},
    ),
    DemoRun(
        "check_address: a postcode that does not exist",
        "check_address",
        {"street": "  12 nowhere   lane ", "postcode": "zz9  9zz"},
        expected_error="AddressNotFound",
    ),
    DemoRun(
        "place_order A-1003: cancelled before any worker runs it",
        "place_order",
        {"order_id": "A-1003", "sku": "mug", "quantity": 1, "payment_token": "tok_visa"},
        cancel_first=True,
    ),
    DemoRun(
        "send_receipt for A-1001: a one-step workflow keyed by its input",
        "send_receipt",
        {"order_id": "A-1001", "email": "ada@example.com"},
        start_again=True,
    ),
)


def run_demo(echo: Echo = click.echo, timeout: float = 30.0) -> None:
    """Run the whole demo in a temporary directory that is removed afterwards."""
    # kombu warns at every connection whose URL names no host, as durablefs:// never does.
    logging.getLogger("kombu.connection").addFilter(
        lambda record: not record.getMessage().startswith("No hostname was supplied")
    )
    # A failure the story shows is reported with its run below, not logged as a traceback.
    expected = {item.expected_error for item in DEMO_RUNS if item.expected_error}
    logging.getLogger("celery.app.trace").addFilter(
        lambda record: not (record.exc_info and type(record.exc_info[1]).__name__ in expected)
    )
    with tempfile.TemporaryDirectory(prefix="durable-demo-") as home, embedded_home(home):
        shop = import_shop()
        durable: Durable = shop.durable
        try:
            demo(durable, echo, timeout)
        finally:
            durable.db.dispose()


@contextmanager
def embedded_home(home: str) -> Iterator[None]:
    """Point the embedded default at ``home``: its SQLite file, and its broker under ``.durable``.

    ``Durable`` keeps the serverless broker's folders under ``.durable/`` of the working
    directory, so the demo works from inside ``home`` and unsets every server address.
    """
    saved_env = {name: os.environ.get(name) for name in SERVER_VARIABLES}
    saved_cwd = os.getcwd()
    # `python -m` put the working directory on sys.path as ""; keep it there as a path.
    sys.path[:] = [os.path.abspath(p) if p in ("", ".") else p for p in sys.path]
    for name in SERVER_VARIABLES:
        os.environ.pop(name, None)
    os.environ["DURABLE_DATABASE_URL"] = "sqlite:///" + os.path.join(home, "durable.sqlite3")
    os.chdir(home)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def import_shop() -> ModuleType:
    """Import the shop shipped with the package; its ``Durable`` is made at import, in ``home``."""
    import importlib

    return importlib.import_module("durable_celery.demo_shop")


def demo(durable: Durable, echo: Echo, timeout: float) -> None:
    """Migrate, start the runs, run a worker until they finish, and report each run."""
    echo("durable_celery demo: the shop's workflows (durable_celery/demo_shop.py) on the embedded default")
    echo("(a SQLite file and the durablefs:// broker in a temporary directory; no servers)")
    echo("")
    echo("Migrating the database")
    durable.migrate(progress=lambda line: echo(f"  {line}"))
    echo("")
    echo("Starting runs (no worker is running yet)")
    run_ids = []
    for number, item in enumerate(DEMO_RUNS, 1):
        run_id = durable.start(item.workflow, item.input)
        run_ids.append(run_id)
        echo(f"  {number}. {item.title}")
        if item.cancel_first:
            cancelled = durable.cancel(run_id)
            echo(f"     cancel() -> {cancelled}, status now {durable.get_run(run_id).status}")
        if item.start_again:
            again = durable.start(item.workflow, item.input)
            echo(f"     started again with the same input -> {same_or_new(again, run_id)}")
    echo("")
    echo("Starting a Celery worker in this process (2 threads) and waiting for every run")
    with worker(durable, concurrency=2):
        finished = [wait_for(durable, run_id, timeout=timeout) for run_id in run_ids]
    for number, (item, run) in enumerate(zip(DEMO_RUNS, finished, strict=True), 1):
        echo("")
        report_run(number, item, run, durable.list_steps(run.id), echo)
    for item, run in zip(DEMO_RUNS, finished, strict=True):
        if item.start_again:
            report_key(durable, item, run, echo)


def report_key(durable: Durable, item: DemoRun, run: Run, echo: Echo) -> None:
    """Start a keyed run's workflow once more now that the run finished, and show the key."""
    reuse = durable.workflows[item.workflow].reuse
    echo("")
    echo(f"Keys: starting {item.workflow} with key {run.key} again, now that its run is {run.status}")
    again = durable.start(item.workflow, item.input)
    echo(f"  reuse={reuse!r} -> {same_or_new(again, run.id)}")
    runs = durable.list_runs(workflow=item.workflow, key=run.key)
    holders = sum(1 for r in runs if r.holds_key)
    echo(f"  runs with key {run.key}: {len(runs)}, holding it: {holders}")
    entries = reversed(durable.activity(kinds=["key_duplicate"], run_id=run.id))
    echo(f"  key_duplicate activity on the run: {', '.join(e.details['outcome'] for e in entries)}")


def same_or_new(run_id: str, first_id: str) -> str:
    """How a start's answer relates to the first run of its key."""
    return "the same run, nothing new started" if run_id == first_id else "a new run"


def report_run(number: int, item: DemoRun, run: Run, steps: list[StepRecord], echo: Echo) -> None:
    """Print one run: status, key, each step attempt, then its output or error."""
    echo(f"{number}. {item.title}")
    echo(f"   status: {run.status}" + (f"  key: {run.key}" if run.key else ""))
    if not steps:
        echo("   no step ran")
    width = max((len(step.name) for step in steps), default=0)
    for step in steps:
        if step.status == "completed":
            outcome = f"completed -> {compact(step.output)}"
        else:
            outcome = f"{step.status}: {describe(step.error)}"
        echo(f"   {step.name:<{width}}  attempt {step.attempt}  {outcome}")
    if run.status == "completed":
        echo(f"   output: {compact(run.output)}")
    elif run.error:
        echo(f"   error: {describe(run.error)}")
    if item.expected_error and (run.error or {}).get("type") == item.expected_error:
        echo("   (the failure this story expects: retried once, as its step says, then the run failed)")


def compact(value: Any) -> str:
    """A JSON value on one line, keys sorted."""
    return json.dumps(value, sort_keys=True)


def describe(error: dict[str, Any] | None) -> str:
    """``Type: message`` of a stored error."""
    if not error:
        return "-"
    return f"{error.get('type')}: {error.get('message')}"
