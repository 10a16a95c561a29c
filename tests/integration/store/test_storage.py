"""What a run stores: its input once (not on every step row), and a bounded dropped input."""

from __future__ import annotations

import hashlib
import json

import pytest
from sqlalchemy import select
from starlette.testclient import TestClient

from durable_celery.core.keys import DROPPED_INPUT_KEPT
from durable_celery.store.schema import activity, steps
from durable_celery.testing import wait_for, worker
from durable_celery.web import create_app
from durable_celery.web.data import run_detail

pytestmark = pytest.mark.timeout(90)


def big_input(size: int) -> dict[str, str]:
    return {"order": "A-1", "blob": "x" * size}


def test_step_rows_keep_no_copy_of_the_run_input(durable):
    wf = durable.workflow("three")

    @wf.step
    def one(order, blob):
        return len(blob)

    @wf.step
    def two(order, blob):
        return order

    @wf.step
    def three(order, blob):
        return "done"

    data = big_input(100_000)
    run_id = durable.start("three", data)
    with worker(durable):
        run = wait_for(durable, run_id)
    assert run.status == "completed"
    with durable.db.engine.connect() as conn:
        raw = conn.execute(select(steps.c.input).where(steps.c.run_id == run_id)).scalars().all()
    assert raw == [None, None, None]
    listed = durable.list_steps(run_id)
    assert [s.name for s in listed] == ["one", "two", "three"]
    assert all(s.input == data for s in listed)


def test_large_dropped_inputs_keep_a_digest_and_a_preview(durable):
    wf = durable.workflow("keyed")

    @wf.step
    def work(order, blob):
        return order

    holder = durable.start("keyed", {"order": "A-1", "blob": ""}, key="k")
    for n in range(10):
        dup = {"order": f"A-{n}", "blob": str(n) * 200_000}
        assert durable.start("keyed", dup, key="k", on_duplicate="use_existing") == holder
    dups = durable.activity(kinds=["key_duplicate"])
    assert len(dups) == 10
    with durable.db.engine.connect() as conn:
        rows = conn.execute(select(activity.c.details).where(activity.c.kind == "key_duplicate")).all()
    assert sum(len(json.dumps(r.details)) for r in rows) < 10_000
    last = dups[0].details
    text = json.dumps({"order": "A-9", "blob": "9" * 200_000}, sort_keys=True, separators=(",", ":"))
    assert "input" not in last and last["input_changed"] is True
    assert last["input_bytes"] == len(text) > DROPPED_INPUT_KEPT
    assert last["input_digest"] == hashlib.sha256(text.encode()).hexdigest()
    assert text.startswith(last["input_preview"]) and 0 < len(last["input_preview"]) <= 512

    key = run_detail(durable, holder)["key"]
    assert len(key["dropped"]) == 10
    shown = key["dropped"][0]
    assert not shown["kept_whole"] and shown["diff"] == []
    assert shown["input_bytes"] == len(text) and shown["input_digest"] == last["input_digest"]
    page = TestClient(create_app(durable, token=None)).get(f"/runs/{holder}").text
    assert 'id="dropped-count">10<' in page
    first = page[page.index('id="dropped-1"') :]
    assert f"{len(text):,} bytes, sha256" in first and last["input_digest"] in first


def test_small_dropped_input_is_kept_whole_with_its_diff(durable):
    wf = durable.workflow("keyed")

    @wf.step
    def work(order, note=""):
        return order

    holder = durable.start("keyed", {"order": "A-1"}, key="k")
    assert (
        durable.start("keyed", {"order": "A-2", "note": "hi"}, key="k", on_duplicate="use_existing") == holder
    )
    (dup,) = durable.activity(kinds=["key_duplicate"])
    assert dup.details["input"] == {"order": "A-2", "note": "hi"}
    assert "input_digest" not in dup.details
    (shown,) = run_detail(durable, holder)["key"]["dropped"]
    assert shown["kept_whole"]
    assert {(d["field"], d["change"]) for d in shown["diff"]} == {("order", "changed"), ("note", "added")}
