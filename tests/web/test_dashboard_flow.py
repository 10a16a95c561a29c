"""The dashboard shows flow control: a run parked for a concurrency slot or by the throttle says
so on its page, the Flow page lists each limit's use per key, the workflow page its limits;
runs parked by a real worker on PostgreSQL."""

from __future__ import annotations

import html
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select
from starlette.testclient import TestClient

from durable_celery.observe.flow import clock_words
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for, worker
from durable_celery.web import create_app

from .conftest import TOKEN, XSS, until

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(120)]


def _rows(durable: Any, run_ids: list[str]) -> dict[str, Any]:
    with durable.db.engine.connect() as conn:
        query = select(runs.c.id, runs.c.flow_wait, runs.c.locked_by, runs.c.due_at).where(
            runs.c.id.in_(run_ids)
        )
        return {row.id: row for row in conn.execute(query)}


def _parked(durable: Any, run_ids: list[str], wait: str, running: int) -> Any:
    rows = _rows(durable, run_ids)
    parked = [i for i, r in rows.items() if r.flow_wait == wait]
    busy = [i for i, r in rows.items() if r.locked_by is not None]
    return parked if parked and len(busy) == running else None


@pytest.fixture
def parked(make_durable: Any) -> Iterator[dict[str, Any]]:
    """A worker running two steps of tenant:A with a third run parked for a slot, and a run of
    api:c1 parked by the throttle (2 per 60 s, both begun)."""
    d = make_durable("webflow")
    go = threading.Event()
    sync = d.workflow("sync", concurrency={"limit": 2, "key": "tenant:{tenant}"})

    @sync.step
    def fetch(tenant: str, n: int) -> None:
        assert go.wait(60), "the test never let the step go"

    api = d.workflow(
        "api",
        throttle={"limit": 2, "period": 60, "key": "api:{customer}"},
        rate_limit={"limit": 5, "period": 3600},
    )

    @api.step
    def call(customer: str, n: int) -> int:
        return n

    try:
        with worker(d, concurrency=5):
            slot_runs = [d.start("sync", {"tenant": "A", "n": n}) for n in range(3)]
            (slot_wait,) = until("a run parked for a slot", lambda: _parked(d, slot_runs, "slot", 2))
            marked = d.start("sync", {"tenant": XSS, "n": 0})  # a key that is a script tag
            slot_runs.append(marked)
            until("the marked run running", lambda: _rows(d, [marked])[marked].locked_by)
            api_runs = [d.start("api", {"customer": "c1", "n": n}) for n in range(3)]
            (throttled,) = until("a run throttled", lambda: _parked(d, api_runs, "throttle", 0))
            yield {
                "durable": d,
                "slot_wait": slot_wait,
                "throttled": throttled,
                "go": go,
                "slot_runs": slot_runs,
            }
            go.set()
            for run_id in slot_runs:
                assert wait_for(d, run_id, timeout=60).status == "completed"
    finally:
        go.set()


def _text(page: str) -> str:
    """The page's text with tags dropped and entities decoded, spaces squeezed."""
    import re

    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def test_run_pages_say_which_limit_holds_them(parked: dict[str, Any]) -> None:
    d = parked["durable"]
    c = TestClient(create_app(d, token=TOKEN))
    page = c.get(f"/runs/{parked['slot_wait']}")
    assert page.status_code == 200
    text = _text(page.text)
    assert "waiting for a concurrency slot (tenant:A, 2 of 2 in use)" in text
    assert 'id="why-flow"' in page.text and 'id="run-state">waiting for a concurrency slot<' in page.text

    due = _rows(d, [parked["throttled"]])[parked["throttled"]].due_at
    page = c.get(f"/runs/{parked['throttled']}")
    text = _text(page.text)
    assert f"throttled until {clock_words(due, d.db.utcnow())} (api:c1, 2 began in the last 60 s)" in text
    assert 'id="run-state">throttled<' in page.text
    assert "retry" not in _text(page.text.split('id="why"')[1].split("</section>")[0]).lower()

    state = c.get(f"/api/runs/{parked['slot_wait']}").json()["state"]
    assert state["label"] == "waiting for a concurrency slot"
    assert state["flow"]["text"] == "waiting for a concurrency slot (tenant:A, 2 of 2 in use)"
    assert state["flow"]["key"] == "tenant:A"


def test_the_flow_page_lists_each_limits_use_per_key(parked: dict[str, Any]) -> None:
    c = TestClient(create_app(parked["durable"]))
    page = c.get("/flow")
    assert page.status_code == 200
    assert '<a href="/flow" class="here">Flow</a>' in page.text
    text = _text(page.text)
    assert "2 at once per tenant:{tenant}" in text
    assert "2 begins per 60s per api:{customer}" in text
    assert "5 starts per 3600s for the whole workflow" in text
    assert "tenant:A 2 of 2 in use 1" in text  # key, use, runs waiting
    assert "api:c1 2 of 2 begun in 60s 1" in text
    assert "the whole workflow 3 of 5 started in 3600s" in text

    only = _text(c.get("/flow?workflow=sync").text)
    assert "tenant:A" in only and "api:c1" not in only
    assert c.get("/flow?workflow=nope").status_code == 400
    assert XSS not in page.text and html.escape(f"tenant:{XSS}") in page.text

    found = c.get("/api/flow").json()
    (sync,) = [w for w in found["workflows"] if w["workflow"] == "sync"]
    a, marked = sync["keys"]  # the key with runs waiting first
    assert (a["kind"], a["key"], a["used"], a["limit"], a["waiting"]) == ("concurrency", "tenant:A", 2, 2, 1)
    assert a["oldest_waiting"] is not None
    assert (marked["key"], marked["used"], marked["waiting"]) == (f"tenant:{XSS}", 1, 0)

    options = _text(c.get("/workflows/api").text)
    assert "throttle 2 begins per 60s per api:{customer}" in options
    assert "rate_limit 5 starts per 3600s for the whole workflow" in options
    assert "concurrency -" in options


def test_the_flow_page_shows_each_fair_keys_share_and_the_held_priorities(make_durable: Any) -> None:
    d = make_durable("webfair")
    go, entered = threading.Event(), threading.Event()
    fair = d.workflow("fair", concurrency={"limit": 1, "fair": "t:{tenant}", "weights": {"t:gold": 3}})

    @fair.step
    def work(tenant: str, n: int) -> None:
        entered.set()
        assert go.wait(60), "the test never let the step go"

    holder = d.start("fair", {"tenant": "gold", "n": 0})
    runner = threading.Thread(target=d.engine.execute, args=(fair, fair.steps[0], holder, False))
    runner.start()
    try:
        assert entered.wait(30)
        waiting = d.start("fair", {"tenant": "gold", "n": 1})
        assert d.engine.execute(fair, fair.steps[0], waiting, False) == "dropped"
        d.start("fair", {"tenant": XSS, "n": 1}, priority=3)  # parked at its start
        c = TestClient(create_app(d))
        page = c.get("/flow")
        text = _text(page.text)
        assert "1 at once for the whole workflow, shared fairly by t:{tenant}" in text
        assert "t:gold 3 1 100% 1" in text  # fair key, weight, slots in use, share, waiting
        assert "held runs by priority: 3: 1, 0: 1" in text
        assert XSS not in page.text and html.escape(f"t:{XSS}") in page.text
        (found,) = c.get("/api/flow").json()["workflows"]
        assert [(f["key"], f["weight"], f["in_use"], f["waiting"]) for f in found["fair"]] == [
            (f"t:{XSS}", 1.0, 0, 1),
            ("t:gold", 3.0, 1, 1),
        ]
        assert found["priorities"] == {"3": 1, "0": 1}
    finally:
        go.set()
        runner.join(30)


def test_the_flow_page_shows_open_batches(make_durable: Any) -> None:
    d = make_durable("webbatch")
    wf = d.workflow("invoice", batch={"max": 4, "period": 60, "key": "invoice:{customer}"})
    wf.step(lambda items: len(items), name="bill")
    run_id = d.start("invoice", {"customer": XSS})
    d.start("invoice", {"customer": XSS})
    c = TestClient(create_app(d))
    page = c.get("/flow")
    text = _text(page.text)
    assert "up to 4 starts a run, gathered for 60s per invoice:{customer}" in text
    assert "Open batches" in text and "2 of 4" in text and run_id[:8] in page.text
    assert XSS not in page.text and html.escape(f"invoice:{XSS}") in page.text
    (found,) = c.get("/api/flow").json()["workflows"]
    assert [(b["key"], b["run_id"], b["items"], b["max"]) for b in found["batches"]] == [
        (f"invoice:{XSS}", run_id, 2, 4)
    ]
    assert found["batches"][0]["closes_at"] is not None
