"""The dashboard and runs in bulk (issue 43): a run's page shows its tags and links the run it
was forked from; the JSON API carries both."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from durable_celery.web import create_app


@pytest.fixture(params=["postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_forks_page_links_its_original_and_shows_its_tags(durable: Any) -> None:
    wf = durable.workflow("shown")
    wf.step(lambda n: n, name="echo")
    original = durable.start(wf, {"n": 1}, tags={"tenant": "acme"})
    assert durable.run_message("shown", 0, original) == "completed"
    forked = durable.fork(original, "echo")
    client = TestClient(create_app(durable))
    page = client.get(f"/runs/{forked}").text
    assert f'<dd id="forked-from"><a class="mono" href="/runs/{original}">{original}</a></dd>' in page
    assert '<span class="mono">tenant=acme</span>' in page
    found = client.get(f"/api/runs/{forked}").json()["run"]
    assert (found["forked_from"], found["tags"]) == (original, {"tenant": "acme"})
    assert 'id="forked-from"' not in client.get(f"/runs/{original}").text


def test_the_runs_page_filters_by_tag_and_window_and_acts_on_all_matching_after_a_preview(
    durable: Any,
) -> None:
    import re
    from datetime import timedelta

    wf = durable.workflow("outage")

    @wf.step
    def pay(n: int) -> None:
        raise ConnectionError("provider down")

    acme = [durable.start(wf, {"n": n}, tags={"tenant": "acme"}) for n in range(3)]
    other = durable.start(wf, {"n": 9}, tags={"tenant": "globex"})
    for run_id in [*acme, other]:
        assert durable.run_message("outage", 0, run_id) == "failed"
    since = (durable.db.utcnow() - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    query = {"status": "failed", "tag": "tenant=acme", "since": since, "error_type": "ConnectionError"}
    anonymous = TestClient(create_app(durable, token="s3cret"))
    listed = anonymous.get("/runs", params=query).text
    assert all(r in listed for r in acme) and other not in listed
    assert 'id="bulk"' not in listed  # acting needs the token
    client = TestClient(create_app(durable, token="s3cret"))
    assert (
        client.post("/login", data={"token": "s3cret", "next": "/runs"}, follow_redirects=False).status_code
        == 303
    )
    page = client.get("/runs", params=query).text
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert csrf and 'id="bulk"' in page
    form = {**query, "csrf": csrf.group(1), "bulk_action": "retry"}
    preview = client.post("/runs/bulk", data={**form, "dry_run": "1"})
    assert "bulk retry: 3 matched, would act on 3" in preview.text
    assert {durable.get_run(r).status for r in acme} == {"failed"}  # a preview changes nothing
    done = client.post("/runs/bulk", data=form)
    assert "bulk retry: 3 matched, did act on 3" in done.text
    assert {durable.get_run(r).status for r in acme} == {"running"} and durable.get_run(
        other
    ).status == "failed"
    assert durable.activity(kinds=["bulk"])[0].details["by"].startswith("dashboard")
    api = client.post(
        "/api/runs/bulk",
        json={**query, "bulk_action": "cancel", "dry_run": True},
        headers={"Authorization": "Bearer s3cret"},
    )
    assert api.json()["result"] == "bulk cancel: 0 matched, would act on 0"  # none failed any more
