"""Which limit holds a run, in words (observe/flow.py ``flow_hold``, observe/why.py): a run
parked for a concurrency slot, one parked by the throttle's window, and runs behind earlier runs
of their key each get their own text, parked by a real worker on PostgreSQL; the Flow report
says the same per key."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import select

from durable_celery.models import aware
from durable_celery.observe.flow import clock_words, flow_hold, flow_report
from durable_celery.observe.why import run_state, stuck_words
from durable_celery.store.flow_reads import run_flow
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for, worker

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("backend", ["postgres"])]


def until(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll ``check`` until it returns something true; TimeoutError naming ``what`` if not."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout}s")
        time.sleep(0.05)
    return found


def parked(durable: Any, run_ids: list[str], wait: str) -> list[str]:
    """The runs of ``run_ids`` parked for ``wait``, in start order."""
    with durable.db.engine.connect() as conn:
        query = select(runs.c.id).where(runs.c.id.in_(run_ids), runs.c.flow_wait == wait)
        found = {row.id for row in conn.execute(query)}
    return [run_id for run_id in run_ids if run_id in found]


def settled(durable: Any, run_ids: list[str]) -> list[str]:
    """The runs of ``run_ids`` parked by the throttle until its window frees a place (not only
    for a look again in a moment), in start order."""
    soon = durable.db.utcnow().timestamp() + 30
    found = parked(durable, run_ids, "throttle")
    return [r for r in found if aware(durable_row(durable, r).due_at).timestamp() > soon]


def hold_of(durable: Any, run_id: str) -> Any:
    with durable.db.engine.connect() as conn:
        return flow_hold(durable.runtime, run_flow(conn, run_id))


def test_a_slot_the_throttle_and_the_line_each_say_what_holds_the_run(durable):
    go = threading.Event()
    sync = durable.workflow("sync", concurrency={"limit": 1, "key": "tenant:{tenant}"})

    @sync.step
    def fetch(tenant, n):
        assert go.wait(60), "the test never let the step go"

    api = durable.workflow("api", throttle={"limit": 2, "period": 60, "key": "api:{customer}"})
    api.step(lambda customer, n: n, name="call")

    try:
        with worker(durable, concurrency=4):
            slot_runs = [durable.start("sync", {"tenant": "A", "n": n}) for n in range(3)]
            first, second = until(
                "two runs parked for the slot",
                lambda: (found := parked(durable, slot_runs, "slot"))[1:] and found,
            )
            assert first == slot_runs[1] and second == slot_runs[2]
            api_runs = [durable.start("api", {"customer": "c1", "n": n}) for n in range(4)]
            for run_id in api_runs[:2]:
                assert wait_for(durable, run_id, timeout=30).status == "completed"
            throttled = until(
                "two runs parked by the throttle until the window frees",
                lambda: (found := settled(durable, api_runs))[1:] and found,
            )
            assert throttled == api_runs[2:]

            head = hold_of(durable, first)
            assert head.text == "waiting for a concurrency slot (tenant:A, 1 of 1 in use)"
            assert (head.wait, head.key, head.behind, head.label) == (
                "slot",
                "tenant:A",
                0,
                "waiting for a concurrency slot",
            )
            behind = hold_of(durable, second)
            assert behind.text == (
                "behind 1 earlier run of this key (tenant:A, waiting for a concurrency slot: 1 of 1 in use)"
            )
            assert (behind.behind, behind.label) == (1, "behind earlier runs of its key")

            now = durable.db.utcnow()
            third = hold_of(durable, throttled[0])
            looks_again = aware(durable_row(durable, throttled[0]).due_at)
            assert third.until == looks_again
            assert (
                third.text
                == f"throttled until {clock_words(looks_again, now)} (api:c1, 2 began in the last 60 s)"
            )
            assert re.fullmatch(r"throttled until (\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d UTC \(.*\)", third.text)
            assert third.label == "throttled"
            fourth = hold_of(durable, throttled[1])
            later = aware(durable_row(durable, throttled[1]).due_at)
            assert fourth.text == (
                f"behind 1 earlier run of this key (api:c1, throttled until {clock_words(later, now)}: "
                "2 began in the last 60 s)"
            )

            # The Flow report says, per key, what its first parked run's page says.
            report = {e.workflow: e for e in flow_report(durable.runtime)}
            (slot_key,) = report["sync"].keys
            assert (
                slot_key.held
                == "waiting for a concurrency slot (tenant:A, 1 of 1 in use); 1 more run behind it"
            )
            (throttle_key,) = report["api"].keys
            assert throttle_key.held == (
                f"throttled until {clock_words(looks_again, now)} (api:c1, 2 began in the last 60 s); "
                "1 more run behind it"
            )

            # The run's state (the run page, the JSON API) and the one line of testing.wait_for.
            state = run_state(durable.runtime, durable.get_run(second), [])
            assert state["label"] == "behind earlier runs of its key" and state["flow"]["text"] == behind.text
            assert (
                stuck_words(durable.runtime, durable.get_run(first), [])
                == f"held by flow control: {head.text}"
            )
            go.set()
            for run_id in slot_runs:
                assert wait_for(durable, run_id, timeout=60).status == "completed"
    finally:
        go.set()
    assert hold_of(durable, slot_runs[2]) is None  # finished: nothing holds it


def durable_row(durable: Any, run_id: str) -> Any:
    with durable.db.engine.connect() as conn:
        return run_flow(conn, run_id)


def test_a_limit_for_the_whole_workflow_says_of_this_workflow(durable):
    entered, go = threading.Event(), threading.Event()
    export = durable.workflow("export", concurrency={"limit": 1})

    @export.step
    def write(n):
        entered.set()
        assert go.wait(60), "the test never let the step go"

    ids = [durable.start("export", {"n": n}) for n in range(3)]
    step = export.steps[0]
    runner = threading.Thread(target=durable.engine.execute, args=(export, step, ids[0], False))
    runner.start()
    try:
        assert entered.wait(30)
        assert [durable.engine.execute(export, step, run_id, False) for run_id in ids[1:]] == ["dropped"] * 2
        assert (
            hold_of(durable, ids[1]).text
            == "waiting for a concurrency slot (the whole workflow, 1 of 1 in use)"
        )
        assert hold_of(durable, ids[2]).text == (
            "behind 1 earlier run of this workflow (waiting for a concurrency slot: 1 of 1 in use)"
        )
    finally:
        go.set()
        runner.join(30)
