"""The dashboard over HTTP (Starlette's TestClient): every page, every action with and without
the token, the JSON API, escaping of user values, 404s, and the refusal to bind without a token."""

from __future__ import annotations

import re
import socket
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from durable_celery.cli.web import web
from durable_celery.errors import DurableError
from durable_celery.testing import wait_for
from durable_celery.web import actions, create_app
from durable_celery.web.auth import check_bind
from durable_celery.web.data import input_diff, parse_search
from tests.conftest import BROKERS

from .conftest import TOKEN, XSS, Scene

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(120)]

PAGES = [
    "/",
    "/runs",
    "/keys",
    "/flow",
    "/workflows/invoice",
    "/workflows/quota",
    "/queues",
    "/schedules",
    "/settings",
]
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def client(scene: Scene, token: str | None = TOKEN) -> TestClient:
    return TestClient(create_app(scene.durable, token=token))


def logged_in(scene: Scene) -> tuple[TestClient, str]:
    """A client holding the session cookie, and the page's CSRF field."""
    c = client(scene)
    assert c.post("/login", data={"token": TOKEN, "next": "/keys"}, follow_redirects=False).status_code == 303
    page = c.get(f"/runs/{scene.held}").text
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert match, "a logged-in page carries the CSRF field"
    return c, match.group(1)


def test_every_page_renders(scene: Scene) -> None:
    c = client(scene)
    for path in PAGES + [f"/runs/{r}" for r in (scene.held, scene.xss, scene.failed, scene.finished)]:
        response = c.get(path)
        assert response.status_code == 200, (path, response.text[:500])
        assert response.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in response.headers["content-security-policy"]
    overview = c.get("/").text
    assert "schema up to date" in overview and scene.queue in overview
    assert "Runs per status" in overview and "Failed in the last hour" in overview
    assert "flaky" in overview  # two failed runs in the last hour
    queues = c.get("/queues").text
    assert scene.queue in queues and "Nodes" in queues
    schedules = c.get("/schedules").text
    assert "quick:cron" in schedules and "*/5 * * * *" in schedules
    settings = c.get("/settings").text
    assert "Prune now" in settings and "postgres@" in settings and "completed" in settings
    flow = c.get("/flow").text
    assert "2 at once per tenant:{tenant}" in flow and "10 begins per 60s per api:{customer}" in flow
    assert "1 start per 3600s for the whole workflow" in flow and "nothing in use" in flow
    assert 'href="/workflows/quota"' in flow and "invoice" not in flow  # only flow-limited workflows
    quota = c.get("/workflows/quota").text
    assert '<dd id="workflow-concurrency">2 at once per tenant:{tenant}' in quota


def test_runs_filters_search_and_paging(scene: Scene) -> None:
    c = client(scene)
    invoice = c.get("/runs", params={"workflow": "invoice"}).text
    assert scene.held in invoice and scene.failed not in invoice
    failed = c.get("/runs", params={"status": "failed"}).text
    assert scene.failed in failed and scene.held not in failed
    by_key = c.get("/runs", params={"q": "key:invoice:42"}).text
    assert scene.held in by_key and scene.finished not in by_key
    by_name = c.get("/runs", params={"q": "quick"}).text
    assert scene.finished in by_name and scene.held not in by_name
    jump = c.get("/runs", params={"q": scene.failed}, follow_redirects=False)
    assert jump.status_code == 303 and jump.headers["location"] == f"/runs/{scene.failed}"
    assert c.get("/runs", params={"q": str(uuid.uuid4())}).status_code == 404
    first = c.get("/runs", params={"limit": 2}).text
    assert 'id="older"' in first
    second = c.get("/runs", params={"limit": 2, "page": 2}).text
    ids = lambda html: set(re.findall(r'href="/runs/([0-9a-f-]{36})"', html))  # noqa: E731
    assert ids(first) and ids(second) and not ids(first) & ids(second)
    older = re.search(r'href="/runs\?([^"]*)" id="older"', first)
    assert older is not None and "after=" in older.group(1)  # keyset: the last run's id
    by_cursor = c.get("/runs?" + older.group(1).replace("&amp;", "&")).text
    assert ids(by_cursor) == ids(second) and 'id="newest"' in by_cursor
    api = c.get("/api/runs", params={"limit": 2}).json()
    assert api["more"] and api["next"] == api["runs"][-1]["id"]
    after = c.get("/api/runs", params={"limit": 2, "after": api["next"]})
    assert {r["id"] for r in after.json()["runs"]} == ids(second)
    assert c.get("/runs", params={"page": 999}).status_code == 400
    assert c.get("/runs", params={"status": "bogus"}).status_code == 400


def test_run_page_shows_the_key_view(scene: Scene) -> None:
    page = client(scene).get(f"/runs/{scene.held}").text
    assert 'id="key-view"' in page and "invoice:42" in page
    assert re.search(r'id="holds">yes<', page)
    assert re.search(r'id="readds">2<', page)
    assert re.search(r'id="dropped-count">1<', page)
    diff = page[page.index('id="dropped-1"') :]
    assert (
        "amount" in diff
        and "- 10" in diff
        and "+ 12" in diff
        and "note" in diff
        and "+ &#34;rush&#34;" in diff
    )
    assert "Waiting for event" in page and "approve" in page
    failed = client(scene).get(f"/runs/{scene.failed}").text
    assert "RuntimeError" in failed and "Traceback" in failed and "about to fail: disk full" in failed
    assert re.search(r"\d+\.\d{3} s", failed)  # each attempt's duration


def test_key_view_shows_the_run_waiting_behind_and_hand_offs(scene: Scene) -> None:
    c, d = client(scene), scene.durable
    holder = d.start("sync", {"account": 7}, key="acct:7")
    wait_for(d, holder, statuses=("waiting",))
    behind = d.start("sync", {"account": 7, "since": "monday"}, key="acct:7")
    assert behind != holder and d.get_run(behind).runs_after_id == holder
    page = c.get(f"/runs/{holder}").text
    waiting = page[page.index("waiting behind (run_again)") :].split("</dd>")[0]
    assert behind in waiting
    page = c.get(f"/runs/{behind}").text
    assert "waits behind" in page and holder in page and re.search(r'id="holds">no</span>: held by', page)
    keys = c.get("/api/keys", params={"workflow": "sync"}).json()["keys"]
    assert [(k["holder_id"], k["waiting_id"]) for k in keys] == [(holder, behind)]

    d.send_event(holder, "go", 1)
    assert wait_for(d, holder).status == "completed"
    wait_for(d, behind, statuses=("waiting",))
    page = c.get(f"/runs/{behind}").text
    assert re.search(r'id="holds">yes<', page)
    history = page[page.index("Hand-offs and releases") :]
    assert "key_handed_off" in history and holder in history

    # The key view lists every run that carried the key, newest first, and which holds it now.
    listed = page[page.index('id="key-runs"') :].split("</table>")[0]
    rows = listed.split("<tr")[2:]
    assert [behind in rows[0], holder in rows[1]] == [True, True] and len(rows) == 2
    assert "(this run)" in rows[0] and ">yes<" in rows[0] and "completed" in rows[1] and ">-<" in rows[1]
    api = c.get(f"/api/runs/{holder}").json()["key"]["runs"]
    assert [(r["id"], r["holds"]) for r in api] == [(behind, True), (holder, False)]


def test_keys_page_and_workflow_keys(scene: Scene) -> None:
    c = client(scene)
    keys = c.get("/keys").text
    assert "invoice:42" in keys and "quick:1" in keys
    row = keys[keys.index(">invoice:42</a>") :].split("</tr>")[0]
    assert "blocked" in row and scene.held in row and ">2</td>" in row
    row = keys[keys.index(">quick:1</a>") :].split("</tr>")[0]
    assert "free to take" in row
    assert "Most re-added" in keys
    prefixed = c.get("/keys", params={"prefix": "quick:"}).text.split("Most re-added")[0]
    assert "quick:1" in prefixed and "invoice:42" not in prefixed
    per_workflow = c.get("/keys", params={"workflow": "invoice"}).text
    assert "invoice:42" in per_workflow and "quick:1" not in per_workflow
    workflow = c.get("/workflows/invoice").text
    assert "invoice:42" in workflow and "quick:1" not in workflow and "approve" in workflow


def test_keys_go_page_by_page_with_after(make_durable: Any) -> None:
    """``/keys`` and ``/api/keys`` page by a key's cursor (``after=``): keys started in one
    transaction share its time, and every key still shows once, to the last page; a bad cursor
    is a 400 on both."""
    d = make_durable("webkeys")
    for name in ("alpha", "beta"):
        d.workflow(name).step(lambda: None, name="only")
    with d.db.begin() as conn:
        names = [(w, f"k{n}") for w in ("alpha", "beta") for n in range(4)]
        for workflow, key in names:
            d.start(workflow, key=key, connection=conn)
    c = TestClient(create_app(d))
    listed = lambda html: re.findall(r'class="mono holder" href="/runs/([^"]+)"', html)  # noqa: E731
    seen, page = [], c.get("/keys", params={"limit": 3}).text
    assert 'id="newest"' not in page
    for _ in range(10):
        seen += listed(page)
        older = re.search(r'href="/keys\?([^"]*)" id="older"', page)
        if older is None:
            break
        assert "after=" in older.group(1)
        page = c.get("/keys?" + older.group(1).replace("&amp;", "&")).text
        assert 'id="newest"' in page
    assert len(seen) == len(set(seen)) == len(names)
    api, walked = c.get("/api/keys", params={"limit": 3, "workflow": "beta"}).json(), []
    while True:
        walked += [(k["workflow"], k["key"]) for k in api["keys"]]
        if not api["more"]:
            break
        api = c.get("/api/keys", params={"limit": 3, "workflow": "beta", "after": api["next"]}).json()
    assert walked == [("beta", f"k{n}") for n in (3, 2, 1, 0)] and api["next"] is None
    for path in ("/keys", "/api/keys"):
        bad = c.get(path, params={"after": "not-a-cursor"})
        assert bad.status_code == 400 and "InvalidArgument" in bad.text, path


def test_user_values_are_escaped(scene: Scene) -> None:
    c = client(scene)
    for path in ["/keys", "/runs", f"/runs/{scene.xss}", "/workflows/flaky", f"/runs?q=key:{XSS}"]:
        html = c.get(path).text
        assert XSS not in html, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html, path
    error = c.get("/runs/" + XSS).text
    assert XSS not in error
    api = c.get(f"/api/runs/{scene.xss}").json()
    assert api["run"]["key"] == XSS and XSS in api["run"]["error"]["message"]


def test_unknown_runs_and_pages_are_404(scene: Scene) -> None:
    c = client(scene)
    missing = str(uuid.uuid4())
    page = c.get(f"/runs/{missing}")
    assert page.status_code == 404 and "RunNotFound" in page.text
    api = c.get(f"/api/runs/{missing}")
    assert api.status_code == 404 and api.json()["error"] == "RunNotFound"
    assert c.post(f"/api/runs/{missing}/cancel", headers=BEARER).json()["error"] == "RunNotFound"
    assert c.get("/no/such/page").status_code == 404
    assert c.get("/api/nothing").json()["error"] == "PageNotFound"


def test_json_api_reads(scene: Scene) -> None:
    c = client(scene)
    runs = c.get("/api/runs", params={"workflow": "invoice"}).json()["runs"]
    assert [r["id"] for r in runs] == [scene.held]
    assert c.get("/api/runs", params={"key": "quick:1"}).json()["runs"][0]["id"] == scene.finished
    assert len(c.get("/api/runs", params={"limit": 1}).json()["runs"]) == 1
    assert c.get("/api/runs", params={"status": "failed"}).json()["runs"]
    bad = c.get("/api/runs", params={"status": "nope"})
    assert bad.status_code == 400 and bad.json()["error"] == "InvalidArgument"
    detail = c.get(f"/api/runs/{scene.held}").json()
    assert detail["run"]["status"] == "waiting" and detail["steps"] == []
    assert detail["key"]["holds"] and detail["key"]["readds"] == 2
    dropped = detail["key"]["dropped"][0]["diff"]
    assert {d["field"] for d in dropped} == {"amount", "note"}
    assert any(a["kind"] == "key_duplicate" for a in detail["activity"])
    keys = c.get("/api/keys", params={"workflow": "invoice"}).json()
    assert [(k["key"], k["blocks"], k["readds_last_day"]) for k in keys["keys"]] == [("invoice:42", True, 2)]
    assert keys["top"][0] == {"workflow": "invoice", "key": "invoice:42", "readds": 2}
    assert [k["key"] for k in c.get("/api/keys", params={"prefix": "quick"}).json()["keys"]] == ["quick:1"]
    queues = c.get("/api/queues").json()
    assert scene.queue in {q["name"] for q in queues["queues"]}
    assert queues["nodes"] and queues["nodes"][0]["live"]
    assert c.get("/api/overview").json()["runs"]["failed"] == 2
    assert c.get("/api/settings").json()["schema"]["up_to_date"]
    (schedule,) = c.get("/api/schedules").json()["schedules"]
    assert schedule["workflow"] == "quick" and schedule["key"] == "quick:cron" and schedule["enabled"]


def _every_action(scene: Scene) -> list[str]:
    paths = [p.replace("{run_id}", scene.held).replace("{name:path}", scene.queue) for p in actions.PATTERNS]
    assert len(paths) == 10  # the runs actions, the queue actions, prune and the bulk action
    return paths


def test_read_only_without_a_token(scene: Scene) -> None:
    c = client(scene, token=None)
    assert 'id="read-only"' in c.get("/").text
    assert 'id="cancel"' not in c.get(f"/runs/{scene.held}").text
    for path in _every_action(scene):
        form = c.post(path, data={"csrf": "x", "name": "approve"})
        assert form.status_code == 403 and "read-only" in form.text, path
        api = c.post("/api" + path, headers=BEARER, json={"name": "approve"})
        assert api.status_code == 403 and api.json()["error"] == "ReadOnly", path
    assert c.post("/login", data={"token": TOKEN}).status_code == 401
    assert scene.durable.get_run(scene.held).status == "waiting"
    assert not scene.durable.stats.queues()[scene.queue]["paused"]


def test_every_action_refused_without_the_token(scene: Scene) -> None:
    c = client(scene)
    for path in _every_action(scene):
        form = c.post(path, data={"csrf": "x", "name": "approve"})
        assert form.status_code == 401 and "Unauthorized" in form.text, path
        api = c.post("/api" + path, json={"name": "approve"})
        assert api.status_code == 401 and api.json()["error"] == "Unauthorized", path
    assert scene.durable.get_run(scene.held).status == "waiting"
    assert not scene.durable.stats.queues()[scene.queue]["paused"]


def test_api_actions_need_the_bearer_token(scene: Scene) -> None:
    c, d = client(scene), scene.durable
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        response = c.post(f"/api/runs/{scene.held}/cancel", headers=headers)
        assert response.status_code == 401 and response.json()["error"] == "Unauthorized"
    assert d.get_run(scene.held).status == "waiting"

    event = c.post(f"/api/runs/{scene.held}/event", headers=BEARER, json={"name": "approve", "payload": 1})
    assert event.json()["ok"], event.text
    assert wait_for(d, scene.held).status == "completed"
    released = c.post(f"/api/runs/{scene.finished}/release-key", headers=BEARER)
    assert released.json()["result"] == "key released"
    again = c.post(f"/api/runs/{scene.finished}/release-key", headers=BEARER)
    assert again.status_code == 409 and again.json()["error"] == "NoKey"
    rerun = c.post(f"/api/runs/{scene.finished}/rerun", headers=BEARER).json()
    new_id = rerun["location"].rsplit("/", 1)[1]
    assert wait_for(d, new_id).output == 42
    retried = c.post(f"/api/runs/{scene.failed}/retry", headers=BEARER)
    assert retried.json()["ok"]
    assert wait_for(d, scene.failed).status == "failed"
    refused = c.post(f"/api/runs/{scene.finished}/retry", headers=BEARER)
    assert refused.status_code >= 400 and refused.json()["error"]


def test_api_cancel_queues_and_prune(scene: Scene) -> None:
    c, d = client(scene), scene.durable
    cancelled = c.post(f"/api/runs/{scene.held}/cancel", headers=BEARER).json()
    assert cancelled["result"] == "cancelled" and d.get_run(scene.held).status == "cancelled"
    assert c.post(f"/api/runs/{scene.held}/cancel", headers=BEARER).json()["result"] == "already finished"
    assert c.post(f"/api/queues/{scene.queue}/pause", headers=BEARER).json()["ok"]
    assert c.get("/api/queues").json()["queues"][0]["paused"] in (True, False)
    assert {q["name"]: q["paused"] for q in c.get("/api/queues").json()["queues"]}[scene.queue]
    assert c.post(f"/api/queues/{scene.queue}/resume", headers=BEARER).json()["ok"]
    assert not {q["name"]: q["paused"] for q in c.get("/api/queues").json()["queues"]}[scene.queue]
    pruned = c.post("/api/prune", headers=BEARER).json()
    assert pruned["result"] == "pruned: completed 0"
    assert c.post("/api/queues/team/slow/pause", headers=BEARER).json()["result"] == "queue team/slow paused"
    assert d.stats.queues()["team/slow"]["paused"]
    bad = c.post(f"/api/runs/{scene.held}/event", headers=BEARER, content=b"[1")
    assert bad.status_code == 400 and bad.json()["error"] == "BadRequest"


def test_form_actions_need_the_session_and_csrf_field(scene: Scene) -> None:
    d = scene.durable
    anonymous = client(scene)
    assert "log in to act" in anonymous.get(f"/runs/{scene.held}").text
    assert anonymous.post(f"/runs/{scene.held}/cancel", data={"csrf": "x"}).status_code == 401
    assert anonymous.post("/login", data={"token": "wrong"}).status_code == 401

    c, csrf = logged_in(scene)
    assert c.post(f"/runs/{scene.held}/cancel").status_code == 401  # the cookie alone is not enough
    assert c.post(f"/runs/{scene.held}/cancel", data={"csrf": "0" * 64}).status_code == 401
    foreign = c.post(
        f"/runs/{scene.held}/cancel", data={"csrf": csrf}, headers={"Origin": "http://evil.example"}
    )
    assert foreign.status_code == 401 and d.get_run(scene.held).status == "waiting"

    done = c.post(f"/runs/{scene.held}/cancel", data={"csrf": csrf}, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"].startswith(f"/runs/{scene.held}?msg=")
    assert d.get_run(scene.held).status == "cancelled"
    shown = c.get(done.headers["location"]).text
    assert 'id="note">cancelled<' in shown and "cancelled" in shown
    refused = c.post(f"/runs/{scene.finished}/retry", data={"csrf": csrf})
    assert refused.status_code >= 400 and "error-detail" in refused.text
    for path in (f"/queues/{scene.queue}/pause", f"/queues/{scene.queue}/resume", "/prune"):
        assert c.post(path, data={"csrf": csrf}, follow_redirects=False).status_code == 303, path
    rerun = c.post(f"/runs/{scene.finished}/rerun", data={"csrf": csrf}, follow_redirects=False)
    assert rerun.status_code == 303 and rerun.headers["location"].startswith("/runs/")
    assert c.post("/logout", follow_redirects=False).status_code == 303


def test_form_event_and_input(scene: Scene) -> None:
    c, csrf = logged_in(scene)
    sent = c.post(
        f"/runs/{scene.held}/event", data={"csrf": csrf, "name": "approve", "payload": '{"ok": true}'}
    )
    assert sent.status_code == 200 and "delivered" in sent.text
    assert wait_for(scene.durable, scene.held).output == {"ok": True}
    kept = c.post(f"/runs/{scene.finished}/input", data={"csrf": csrf, "name": "x", "value": "not json"})
    assert kept.status_code == 400 and "not JSON" in kept.text

    d = scene.durable
    asking = d.start("approval", {"item": "laptop"})
    wait_for(d, asking, statuses=("waiting",))
    page = c.get(f"/runs/{asking}").text
    assert "Waiting for input" in page and "decision" in page and "Provide input" in page
    given = c.post(f"/runs/{asking}/input", data={"csrf": csrf, "name": "decision", "value": '"yes"'})
    assert given.status_code == 200 and "input decision given" in given.text
    assert wait_for(d, asking).output == {"item": "laptop", "answer": "yes"}


def test_binding_elsewhere_needs_a_token() -> None:
    check_bind("127.0.0.1", None)
    check_bind("localhost", None)
    check_bind("::1", None)
    check_bind("0.0.0.0", "T")
    for host in ("0.0.0.0", "192.168.1.5", "example.com"):
        with pytest.raises(DurableError, match="without a token"):
            check_bind(host, None)
    result = CliRunner().invoke(web, ["--host", "0.0.0.0"], obj=SimpleNamespace(app=None), env={})
    assert result.exit_code != 0 and "without a token" in result.output


def test_search_and_diff_helpers() -> None:
    assert parse_search("key:invoice:42", []) == {"key": "invoice:42"}
    run_id = str(uuid.uuid4())
    assert parse_search(run_id.upper(), []) == {"run_id": run_id}
    assert parse_search("invoice", ["invoice"]) == {"workflow": "invoice"}
    assert parse_search("something", ["invoice"]) == {"key": "something"}
    diff: list[dict[str, Any]] = input_diff({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4})
    assert [(d["field"], d["change"]) for d in diff] == [("b", "changed"), ("c", "added")]
    assert input_diff([1], [1]) == [] and input_diff(1, 2)[0]["change"] == "changed"


def test_settings_hide_secrets() -> None:
    from durable_celery.web.data import mask_setting

    shown = mask_setting("database_url", "postgresql://app:hunter2@db.example/shop")
    assert "hunter2" not in shown and "db.example/shop" in shown
    assert mask_setting("api_token", "abc") == "***" and mask_setting("pool_size", 5) == 5
    assert mask_setting("tracer_provider", object()) == "object"


def test_web_command_takes_the_token_from_the_environment(
    scene: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    served: dict[str, Any] = {}

    def serve(server: Any, sockets: list[Any]) -> None:
        (listening,) = sockets
        host, port = listening.getsockname()[:2]
        listening.close()
        served.update(app=server.config.app, host=host, port=port)

    monkeypatch.setattr(uvicorn.Server, "run", serve)
    obj = SimpleNamespace(app=scene.durable.app)
    port = _free_port()
    result = CliRunner().invoke(
        web, ["--host", "0.0.0.0", "--port", str(port)], obj=obj, env={"DURABLE_WEB_TOKEN": "T"}
    )
    assert result.exit_code == 0, result.output
    assert "actions need the token" in result.output
    assert served["host"] == "0.0.0.0" and served["port"] == port
    assert served["app"].state.dashboard.token == "T"
    result = CliRunner().invoke(web, [], obj=obj, env={"DURABLE_WEB_TOKEN": ""})
    assert result.exit_code == 0 and "read-only" in result.output
    assert (
        served["host"] == "127.0.0.1"
        and served["port"] == 5557
        and served["app"].state.dashboard.token is None
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("backend", BROKERS)  # the worker's node and queues on Redis, RabbitMQ
def test_queues_page_lists_stale_take_backs_of_the_day(scene: Scene) -> None:
    from datetime import timedelta

    from sqlalchemy import update

    from durable_celery.core.sweeps import sweep_stale_once
    from durable_celery.store.db import utcnow
    from durable_celery.store.schema import runs

    d = scene.durable
    # What a worker that vanished mid-step leaves: the run locked, its heartbeat an hour old.
    with d.db.begin() as conn:
        conn.execute(
            update(runs)
            .where(runs.c.id == scene.held)
            .values(status="running", locked_by="ghost-node:1", heartbeat_at=utcnow() - timedelta(hours=1))
        )
    assert sweep_stale_once(d.runtime)[0] == [scene.held]
    page = client(scene).get("/queues").text
    assert "stale_recovered" in page and scene.held in page and "ghost-node:1" in page
    shown = client(scene).get("/api/queues").json()
    assert shown["recoveries"]["stale_recovered"] == 1
    (queue,) = [q for q in shown["queues"] if q["name"] == scene.queue]
    assert queue["consumers"] and not queue["no_consumer"]  # the scene's worker, live
