"""Which limit holds a run reads the same everywhere: a run waiting for a concurrency slot, one
throttled until its window frees a place and runs behind earlier runs of their key say so on
their run pages, in the JSON API, on the Flow page and in ``durable flow``; the Overview counts
runs held by flow control apart from the ``waiting`` status. Runs parked by a real worker on
PostgreSQL."""

from __future__ import annotations

import html
import json
import re
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from starlette.testclient import TestClient

from durable_celery import current_run
from durable_celery.cli import durable as durable_cli
from durable_celery.models import aware
from durable_celery.observe.flow import clock_words
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for, worker
from durable_celery.web import create_app

from .conftest import TOKEN, until

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(120)]


def _flow_rows(durable: Any, run_ids: list[str]) -> dict[str, Any]:
    with durable.db.engine.connect() as conn:
        query = select(runs.c.id, runs.c.flow_wait, runs.c.due_at).where(runs.c.id.in_(run_ids))
        return {row.id: row for row in conn.execute(query)}


def _parked(durable: Any, run_ids: list[str], wait: str, after: float = 0.0) -> list[str] | None:
    """The runs of ``run_ids`` parked for ``wait`` (by the throttle: due more than ``after``
    seconds from now), in start order; None until two are."""
    rows = _flow_rows(durable, run_ids)
    later = durable.db.utcnow().timestamp() + after
    found = [
        i
        for i in run_ids
        if rows[i].flow_wait == wait and (wait == "slot" or aware(rows[i].due_at).timestamp() > later)
    ]
    return found if len(found) >= 2 else None


@pytest.fixture
def held(make_durable: Any) -> Iterator[dict[str, Any]]:
    """tenant:A's one slot held by a running step, a run parked for it and one behind that;
    api:c1 with 2 begun in its 60 s window, a run throttled and one behind it; a run waiting
    for an event."""
    d = make_durable("webwords")
    go = threading.Event()
    sync = d.workflow("sync", concurrency={"limit": 1, "key": "tenant:{tenant}"})

    @sync.step
    def fetch(tenant: str, n: int) -> None:
        assert go.wait(60), "the test never let the step go"

    api = d.workflow("api", throttle={"limit": 2, "period": 60, "key": "api:{customer}"})
    api.step(lambda customer, n: n, name="call")
    approval = d.workflow("approval")
    approval.step(lambda item: current_run().wait_for_event("approve"), name="ask")

    try:
        with worker(d, concurrency=4):
            slot_runs = [d.start("sync", {"tenant": "A", "n": n}) for n in range(3)]
            slot_head, slot_behind = until(
                "two runs parked for a slot", lambda: _parked(d, slot_runs, "slot")
            )
            api_runs = [d.start("api", {"customer": "c1", "n": n}) for n in range(4)]
            for run_id in api_runs[:2]:
                assert wait_for(d, run_id, timeout=30).status == "completed"
            throttled, throttled_behind = until(
                "two runs throttled until the window frees a place",
                lambda: _parked(d, api_runs, "throttle", after=30),
            )
            asking = d.start("approval", {"item": "chair"})
            wait_for(d, asking, statuses=("waiting",))
            yield {
                "durable": d,
                "slot_head": slot_head,
                "slot_behind": slot_behind,
                "throttled": throttled,
                "throttled_behind": throttled_behind,
                "asking": asking,
            }
            go.set()
            for run_id in slot_runs:
                assert wait_for(d, run_id, timeout=60).status == "completed"
    finally:
        go.set()


def _text(page: str) -> str:
    """The page's text with tags dropped and entities decoded, spaces squeezed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def _span(page: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}">(.*?)</span>', page)
    assert found, element_id
    return html.unescape(found.group(1))


def test_each_run_page_and_the_api_say_which_limit_holds_it(held: dict[str, Any]) -> None:
    d = held["durable"]
    c = TestClient(create_app(d, token=TOKEN))
    now = d.db.utcnow()
    rows = _flow_rows(d, [held["throttled"], held["throttled_behind"]])
    until_first = clock_words(aware(rows[held["throttled"]].due_at), now)
    until_second = clock_words(aware(rows[held["throttled_behind"]].due_at), now)
    expected = {
        "slot_head": (
            "waiting for a concurrency slot",
            "waiting for a concurrency slot (tenant:A, 1 of 1 in use)",
        ),
        "slot_behind": (
            "behind earlier runs of its key",
            "behind 1 earlier run of this key (tenant:A, waiting for a concurrency slot: 1 of 1 in use)",
        ),
        "throttled": ("throttled", f"throttled until {until_first} (api:c1, 2 began in the last 60 s)"),
        "throttled_behind": (
            "behind earlier runs of its key",
            f"behind 1 earlier run of this key (api:c1, throttled until {until_second}: "
            "2 began in the last 60 s)",
        ),
    }
    for name, (label, text) in expected.items():
        page = c.get(f"/runs/{held[name]}").text
        assert _span(page, "run-state") == label, name
        assert _span(page, "flow-wait") == text, name
        state = c.get(f"/api/runs/{held[name]}").json()["state"]
        assert (state["label"], state["flow"]["text"]) == (label, text), name
    assert re.fullmatch(r"(\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d UTC", until_first)
    throttled_page = _text(c.get(f"/runs/{held['throttled']}").text)
    assert "a worker claimed their first step" in throttled_page  # the throttle counts claims


def test_the_flow_page_and_the_cli_say_what_the_first_run_page_says(held: dict[str, Any]) -> None:
    d = held["durable"]
    c = TestClient(create_app(d, token=TOKEN))
    first = _span(c.get(f"/runs/{held['slot_head']}").text, "flow-wait")
    throttled = _span(c.get(f"/runs/{held['throttled']}").text, "flow-wait")
    slot_held, throttle_held = f"{first}; 1 more run behind it", f"{throttled}; 1 more run behind it"

    page = _text(c.get("/flow").text)
    assert slot_held in page and throttle_held in page
    found = {
        (k["kind"], k["key"]): k["held"] for w in c.get("/api/flow").json()["workflows"] for k in w["keys"]
    }
    assert found == {("concurrency", "tenant:A"): slot_held, ("throttle", "api:c1"): throttle_held}

    cli = CliRunner()
    out = cli.invoke(durable_cli, ["flow"], obj=SimpleNamespace(app=d.app))
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert f"    held: {slot_held}" in lines and f"    held: {throttle_held}" in lines
    out = cli.invoke(durable_cli, ["flow", "--json"], obj=SimpleNamespace(app=d.app))
    assert {(e["kind"], e["key"]): e["held"] for e in map(json.loads, out.output.splitlines())} == found


def test_the_overview_counts_runs_held_by_flow_control_apart_from_waiting(held: dict[str, Any]) -> None:
    d = held["durable"]
    c = TestClient(create_app(d, token=TOKEN))
    page = c.get("/").text
    tile = re.search(r'id="held-by-flow"><span class="n">(\d+)</span>held by flow control</a>', page)
    assert tile and tile.group(1) == "4"
    assert re.search(r'href="/runs\?status=waiting"><span class="n">1</span>', page)  # the event's run
    queue = d.app.conf.task_default_queue
    row = page[page.index('id="overview-queues"') :].split(f"<td>{queue}</td>")[1].split("</tr>")[0]
    ready, running, waiting, held_here, later = re.findall(r'<td class="num">(\d+)</td>', row)
    assert (running, waiting, held_here, later) == ("1", "1", "4", "0")
    assert "<th>waiting</th><th>held by flow control</th>" in page

    shown = c.get("/api/overview").json()
    assert shown["held_by_flow"] == 4 and shown["runs"]["waiting"] == 1
    (entry,) = [q for q in shown["queues"] if q["name"] == queue]
    assert (entry["waiting"], entry["held"], entry["later"]) == (1, 4, 0)
