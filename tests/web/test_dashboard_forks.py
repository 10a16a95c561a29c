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
