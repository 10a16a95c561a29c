"""The dashboard says why a run is not moving: a retry waiting out its backoff, a debounce, a
queue no worker consumes, a compensation that failed. Also: one word for "holds", step names,
times with their zone and age, the workflow's options, what log capture keeps, and who
cancelled or retried a run (after a confirmation page)."""

from __future__ import annotations

import html
import logging
import re
from datetime import datetime, timedelta, timezone
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from durable_celery.cli import durable as durable_cli
from durable_celery.instrument.logs import LogCapture
from durable_celery.testing import wait_for
from durable_celery.web import create_app
from durable_celery.web.data import log_capture_text
from durable_celery.web.server import age

from .conftest import TOKEN, Scene, stuck_runs

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(120)]

BEARER = {"Authorization": f"Bearer {TOKEN}"}


def client(scene: Scene) -> TestClient:
    return TestClient(create_app(scene.durable, token=TOKEN))


class _Text(HTMLParser):
    """Collects the text of the element with one id, nested elements included."""

    VOID = {"input", "br", "meta", "link", "img", "hr"}

    def __init__(self, element_id: str) -> None:
        super().__init__()
        self.element_id, self.depth, self.found, self.parts = element_id, 0, False, []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.VOID:
            return
        if self.depth:
            self.depth += 1
        elif ("id", self.element_id) in attrs:
            self.depth, self.found = 1, True

    def handle_endtag(self, tag: str) -> None:
        if self.depth and tag not in self.VOID:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.parts.append(data)


def text_of(page: str, element_id: str) -> str:
    """The text inside the element with this id (tags dropped, spaces collapsed)."""
    parser = _Text(element_id)
    parser.feed(page)
    assert parser.found, f"no element {element_id}"
    return " ".join("".join(parser.parts).split())


def test_each_stuck_run_says_why_on_its_page(scene: Scene) -> None:
    stuck = stuck_runs(scene)
    c = client(scene)

    page = c.get(f"/runs/{stuck.retrying}").text
    assert text_of(page, "run-state") == "retry backoff"
    retry = text_of(page, "why-retry")
    assert "Attempt 1 of step charge failed" in retry and "RuntimeError: card 4242 declined" in retry
    assert "Attempt 2 of 3 is due" in retry
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC in [45] min", text_of(page, "next-attempt"))
    assert "charge" in text_of(page, "run-step") and "attempt 2 of 3" in text_of(page, "run-step")
    api = c.get(f"/api/runs/{stuck.retrying}").json()["state"]
    assert api["retry"]["failed_attempt"] == 1 and api["retry"]["next_attempt"] == 2
    assert api["retry"]["error"]["message"] == "card 4242 declined"

    page = c.get(f"/runs/{stuck.debounced}").text
    assert text_of(page, "run-state") == "debounced"
    debounce = text_of(page, "why-debounce")
    assert "once no new start with its key has come for 10 min" in debounce
    assert re.search(r"UTC in (9|10) min$", text_of(page, "debounce-due"))
    assert re.search(r"UTC in (59|60) min$", text_of(page, "debounce-cap"))
    assert "(1 h after the first start)" in debounce
    assert 'id="why-queue"' not in page  # its queue has a live consumer

    page = c.get(f"/runs/{stuck.no_consumer}").text
    assert text_of(page, "run-state") == "no consumer"
    queue = text_of(page, "why-queue")
    assert f"No live worker consumes queue {stuck.queue}" in queue and f"-Q {stuck.queue}" in queue
    assert scene.durable.get_run(stuck.no_consumer).status == "pending"

    page = c.get(f"/runs/{stuck.compensation_failed}").text
    assert text_of(page, "run-state") == "not compensated: book"
    assert text_of(page, "uncompensated-step") == "book"
    why = text_of(page, "why-compensation")
    assert "after 1 attempt(s)" in why and "RuntimeError: hotel in Oslo refuses the refund" in why
    assert text_of(page, "not-compensated") == "book"

    # A run that is simply waiting for its event, or finished, has nothing to explain.
    for run_id in (scene.held, scene.finished):
        page = c.get(f"/runs/{run_id}").text
        assert 'id="why"' not in page and 'id="run-state"' not in page


def test_paused_queue_is_named_on_the_run_page(scene: Scene) -> None:
    d = scene.durable
    d.pause_queue(scene.queue)
    try:
        run_id = d.start("quick", {"n": 5})
        page = client(scene).get(f"/runs/{run_id}").text
        assert text_of(page, "run-state") == "queue paused"
        assert f"Queue {scene.queue} is paused" in text_of(page, "why-queue")
    finally:
        d.resume_queue(scene.queue)
    assert wait_for(d, run_id).output == 10


def test_runs_list_holds_word_matches_the_cli_and_keys(scene: Scene) -> None:
    c = client(scene)
    page = c.get("/runs").text
    rows = {
        rid: page[page.index(f'href="/runs/{rid}"') :].split("</tr>")[0]
        for rid in (
            scene.held,
            scene.finished,
            scene.failed,
        )
    }

    def cell(row: str, name: str) -> str:
        found = re.search(rf'class="{name}">(.*?)</td>', row)
        assert found, (name, row)
        return html.unescape(re.sub(r"<[^>]+>", "", found.group(1)))

    page_words = {rid: cell(row, "holds") for rid, row in rows.items()}
    assert page_words == {scene.held: "yes", scene.finished: "free", scene.failed: "-"}
    assert tuple(cell(rows[r], "step") for r in (scene.held, scene.finished, scene.failed)) == (
        "approve",
        "done",
        "explode",
    )

    result = CliRunner().invoke(
        durable_cli, ["runs", "-n", "100"], obj=SimpleNamespace(app=scene.durable.app)
    )
    assert result.exit_code == 0, result.output
    cli_words = {
        line.split()[0]: line.split()[5] for line in result.output.splitlines()[1:] if line.split()[0] in rows
    }
    assert cli_words == page_words
    keys = c.get("/keys").text
    assert "free to take" in keys[keys.index(">quick:1</a>") :].split("</tr>")[0]
    assert text_of(c.get(f"/runs/{scene.finished}").text, "holds") == "free"
    api = {r["id"]: r["holds"] for r in c.get("/api/runs", params={"limit": 100}).json()["runs"]}
    assert {rid: api[rid] for rid in rows} == page_words


def test_cancel_asks_first_and_cancel_and_retry_say_who(scene: Scene) -> None:
    d = scene.durable
    c = client(scene)
    assert c.post("/login", data={"token": TOKEN}, follow_redirects=False).status_code == 303
    page = c.get(f"/runs/{scene.held}").text
    assert f'href="/runs/{scene.held}/cancel" id="cancel"' in page
    assert f'action="/runs/{scene.held}/cancel"' not in page  # no one-click cancel form
    confirm = c.get(f"/runs/{scene.held}/cancel").text
    assert "Cancel run" in confirm and 'id="confirm-cancel"' in confirm and 'id="keep-run"' in confirm
    assert d.get_run(scene.held).status == "waiting"  # looking at the question cancels nothing
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', confirm).group(1)  # type: ignore[union-attr]
    done = c.post(f"/runs/{scene.held}/cancel", data={"csrf": csrf}, follow_redirects=False)
    assert done.status_code == 303 and d.get_run(scene.held).status == "cancelled"
    (entry,) = d.activity(kinds=["cancelled"], run_id=scene.held)
    assert entry.details["by"] == "dashboard" and entry.details["from"] == "testclient"
    assert entry.key == "invoice:42"
    assert "already finished" in c.get(f"/runs/{scene.held}/cancel").text

    assert c.post(f"/api/runs/{scene.failed}/retry", headers=BEARER).json()["ok"]
    (entry,) = d.activity(kinds=["retried"], run_id=scene.failed)
    assert (entry.details["by"], entry.details["from"], entry.details["attempt"]) == ("api", "testclient", 2)
    assert wait_for(d, scene.failed).status == "failed"
    page = c.get(f"/runs/{scene.failed}").text
    activity = page[page.index('id="activity"') :]
    assert "retried" in activity and "&#34;by&#34;: &#34;api&#34;" in activity

    asking = d.start("approval", {"item": "chair"})
    wait_for(d, asking, statuses=("waiting",))
    assert c.post(f"/api/runs/{asking}/cancel", headers=BEARER).json()["result"] == "cancelled"
    assert d.activity(kinds=["cancelled"], run_id=asking)[0].details["by"] == "api"
    d.cancel(d.start("approval", {"item": "desk"}), by="ops", origin="cli")
    assert {"ops"} <= {a.details["by"] for a in d.activity(kinds=["cancelled"])}


def test_workflow_page_shows_each_steps_options(scene: Scene) -> None:
    c = client(scene)
    payment = c.get("/workflows/payment").text
    row = payment[payment.index('id="workflow-steps"') :].split("</tr>")[1]
    assert "charge" in row and '<td class="num">3</td>' in row and "300 s (backoff_max)" in row
    assert scene.queue in row
    trip = c.get("/workflows/trip").text
    book = trip[trip.index('id="workflow-steps"') :].split("</tr>")[1]
    assert "unbook" in book and "(1 attempts)" in book
    autosave = c.get("/workflows/autosave").text
    assert text_of(autosave, "workflow-debounce") == "period 10 min, at most 1 h after the first start"
    report = c.get("/workflows/report").text
    assert f"{scene.queue}-nobody" in report[report.index('id="workflow-steps"') :]
    quick = c.get("/workflows/quick").text
    options = text_of(quick, "workflow-options")
    assert "after_close" in options and "use_existing" in options and "optional" in options


def test_settings_say_what_log_capture_keeps(scene: Scene) -> None:
    page = client(scene).get("/settings").text
    row = page[page.index("<th>log_capture</th>") :].split("</tr>")[0]
    assert "WARNING and above, all metadata" in html.unescape(row) and "null" not in row
    assert log_capture_text(LogCapture.from_setting(None)) == "WARNING and above, all metadata"
    assert log_capture_text(LogCapture.from_setting(False)) == "off: no log lines are saved"
    every = LogCapture.from_setting({"levels": "all", "metadata_filter": ["account"], "console": False})
    assert log_capture_text(every) == "every level, metadata account only; saved lines kept off the console"
    some = LogCapture.from_setting({"levels": ["ERROR", logging.DEBUG]})
    assert log_capture_text(some) == "DEBUG, ERROR, all metadata"


def test_times_show_their_zone_and_age(scene: Scene) -> None:
    page = client(scene).get(f"/runs/{scene.finished}").text
    created = scene.durable.get_run(scene.finished).created_at
    assert re.search(
        re.escape(created.strftime("%Y-%m-%d %H:%M:%S"))
        + r' UTC</time> <span class="age">(\d+ s ago|now)</span>',
        page,
    )
    now = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
    assert age(now - timedelta(minutes=3, seconds=5), now) == "3 min ago"
    assert age(now + timedelta(seconds=20), now) == "in 20 s"
    assert age(now + timedelta(hours=2), now) == "in 2 h"
    assert age(now - timedelta(days=3), now) == "3 d ago"
    assert age(now, now) == "now"
