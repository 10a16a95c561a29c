"""``durable keys`` (text, ``--json``, ``--html``, ``-k``, ``-w``, ``--after``), whether a key blocks a new
start, ``runs``' holds column, and ``--json`` on show, queues, nodes and cleanup: each through
a real ``celery -A ... durable`` process on PostgreSQL."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import insert

from durable_celery.errors import InvalidArgument
from durable_celery.observe.activity import list_keys
from durable_celery.store.db import utcnow
from durable_celery.store.schema import nodes
from durable_celery.testing import wait_for, worker
from tests.integration.helpers import cli_app

pytestmark = pytest.mark.timeout(120)
postgres_only = pytest.mark.parametrize("backend", ["postgres"])  # the CLI, with Redis

SCRIPT = "<script>alert(1)</script>"

# Defined alike in the test and in the app the CLI loads: whether a key blocks depends on reuse.
DEFINE = """
def define(durable):
    for name, reuse in (("close", "after_close"), ("once", "after_failure")):
        durable.workflow(name, reuse=reuse).step(lambda n=0: n, name="work")
"""


def define(durable):
    namespace: dict = {}
    exec(DEFINE, namespace)
    namespace["define"](durable)


@pytest.fixture
def cli(durable, tmp_path):
    return cli_app(durable, tmp_path, "keysapp", DEFINE, ())


@pytest.fixture
def holders(durable):
    """One holder per case: finished under after_close and after_failure, unfinished, and keys
    with LIKE's wildcards and with markup in them."""
    define(durable)
    ids = {
        "closed": durable.start("close", {"n": 1}, key="done:1"),
        "succeeded": durable.start("once", {"n": 2}, key="done:2"),
    }
    with worker(durable):
        for run_id in ids.values():
            assert wait_for(durable, run_id).status == "completed"
    ids["going"] = durable.start("close", key="going:1")
    ids["wild"] = durable.start("close", key="100%_off")
    ids["tame"] = durable.start("close", key="100xxoff")  # what an unescaped LIKE '100%_%' matches too
    ids["script"] = durable.start("once", key=SCRIPT)
    durable.start("once", key=SCRIPT)  # a re-add, answered by the holder
    return ids


def rows_by_key(report: str) -> dict[str, list[str]]:
    found = {}
    for line in report.splitlines():
        for key in ("done:1", "done:2", "going:1", "100%_off", "100xxoff"):
            if line.split()[1:2] == [key]:
                found[key] = line.split()
    return found


@postgres_only
def test_keys_show_whether_each_key_blocks_a_new_start(durable, holders, cli):
    report = cli("keys")
    rows = rows_by_key(report)
    # columns: workflow key holder status blocks waiting runs re-adds
    assert rows["done:1"][:5] == ["close", "done:1", holders["closed"], "completed", "free"]
    assert rows["done:2"][:5] == ["once", "done:2", holders["succeeded"], "completed", "yes"]
    assert rows["going:1"][:5] == ["close", "going:1", holders["going"], "pending", "yes"]
    assert "keys held: 6 (5 block new starts, 1 free to take)" in report
    assert "6 keys, 5 block new starts (every workflow)" in report


@postgres_only
def test_runs_say_whether_the_key_they_hold_blocks(holders, cli):
    (closed,) = [
        line for line in cli("runs", "-k", "done:1").splitlines() if line.startswith(holders["closed"])
    ]
    (succeeded,) = [
        line for line in cli("runs", "-k", "done:2").splitlines() if line.startswith(holders["succeeded"])
    ]
    assert closed.split()[5] == "free" and succeeded.split()[5] == "yes"
    (line,) = cli("runs", "-k", "done:1", "--json").splitlines()
    assert json.loads(line)["holds_key"] is True and json.loads(line)["key_blocks"] is False


@postgres_only
def test_keys_prefix_escapes_like_wildcards_and_workflow_filters(durable, holders, cli):
    lines = cli("keys", "-k", "100%_", "--json").splitlines()
    assert [json.loads(line)["key"] for line in lines] == ["100%_off"]

    entries = [json.loads(line) for line in cli("keys", "-w", "once", "--json").splitlines()]
    assert sorted(e["key"] for e in entries) == sorted(["done:2", SCRIPT])
    (script,) = [e for e in entries if e["key"] == SCRIPT]
    assert script.pop("taken_at").startswith(utcnow().strftime("%Y-"))
    assert script == {
        "workflow": "once",
        "key": SCRIPT,
        "holder_id": holders["script"],
        "holder_status": "pending",
        "waiting_id": None,
        "runs": 1,
        "readds_last_day": 1,
        "blocks": True,
    }
    text = cli("keys", "-w", "close", "--key", "done:")
    assert "1 key, 0 block new starts (workflow close, keys starting with 'done:')" in text
    # The counts above the rows are the whole workflow's, and say so.
    lines = cli("keys", "--key", "done:").splitlines()
    assert lines[0] == "every workflow, every key:" and lines[1].startswith("keys held: 6 ")
    assert lines[-1].startswith("2 keys, ") and lines[-1].endswith(
        "(every workflow, keys starting with 'done:')"
    )
    assert cli("keys").splitlines()[0].startswith("keys held: 6 ")
    assert "give --json or --html, not both" in cli("keys", "--json", "--html", "-", code=2)


@postgres_only
def test_keys_html_report_is_one_escaped_static_page(holders, cli, tmp_path):
    page = tmp_path / "keys.html"
    said = cli("keys", "--html", str(page))
    assert f"key report (6 keys) written to {page}" in said
    html = page.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<script" not in html and "src=" not in html and "<link" not in html  # nothing to fetch or run
    assert "6 keys" in html and "5 block new starts" in html and "1 free to take" in html
    assert "generated at" in html and "Re-added most in the last 24 hours" in html
    assert html.count('<td class="free">free to take</td>') == 1
    to_stdout = cli("keys", "-w", "once", "--html", "-")
    assert to_stdout.startswith("<!DOCTYPE html>") and to_stdout.rstrip().endswith("</html>")


@postgres_only
def test_json_on_show_queues_nodes_and_cleanup(durable, holders, cli):
    with durable.db.begin() as conn:
        conn.execute(
            insert(nodes).values(
                name="celery@keysbox", queues=["default"], pid=4242, started_at=utcnow(), seen_at=utcnow()
            )
        )
    shown = json.loads(cli("show", holders["closed"], "--json"))
    assert shown["id"] == holders["closed"] and shown["status"] == "completed"
    assert shown["key_blocks"] is False and shown["children"] == []
    assert [(s["name"], s["status"], s["output"]) for s in shown["steps"]] == [("work", "completed", 1)]
    text = cli("show", holders["succeeded"])
    assert "status      completed" in text and "done:2 (holds it, blocks new starts)" in text
    assert "0. work attempt 1: completed 2" in text

    queues = [json.loads(line) for line in cli("queues", "--json").splitlines()]
    (mine,) = [q for q in queues if q["queue"] == durable.app.conf.task_default_queue]
    assert (mine["ready"], mine["running"], mine["paused"]) == (4, 0, False)
    found = [json.loads(line) for line in cli("nodes", "--json").splitlines()]
    assert any(n["name"] == "celery@keysbox" and n["queues"] == ["default"] for n in found)

    counts = json.loads(cli("cleanup", "--older-than", "1d", "--dry-run", "--json"))
    assert counts == {"runs": 0, "steps": 0, "events": 0, "dry_run": True}


def test_list_keys_by_prefix_and_the_blocking_count(durable, holders):
    """On both backends: the prefix is literal and case counts; ``stats.keys()`` counts the
    keys that block apart from the ones held."""
    assert [e.key for e in list_keys(durable.runtime, prefix="100%_")] == ["100%_off"]
    assert sorted(e.key for e in list_keys(durable.runtime, prefix="100")) == ["100%_off", "100xxoff"]
    assert list_keys(durable.runtime, prefix="DONE:") == []  # SQLite's LIKE alone would match "done:"
    assert {e.key: e.blocks for e in list_keys(durable.runtime, prefix="done:")} == {
        "done:1": False,
        "done:2": True,
    }
    with pytest.raises(InvalidArgument):
        list_keys(durable.runtime, prefix=100)
    stats = durable.stats.keys()
    assert (stats["keys_held"], stats["blocking"]) == (6, 5)
    assert durable.stats.keys(workflow="once")["blocking"] == 2
    # The finished after_close holder lets its key go: the next start takes it, and it blocks.
    assert durable.start("close", {"n": 3}, key="done:1") != holders["closed"]
    assert (durable.stats.keys()["keys_held"], durable.stats.keys()["blocking"]) == (6, 6)


@postgres_only
def test_runs_go_page_by_page_with_after(holders, cli):
    """``durable runs -n 2`` ends with the next page's option; following it lists older runs,
    never one twice, to the last page (no hint)."""
    seen: list[str] = []
    args = ["runs", "-n", "2"]
    for _ in range(10):
        lines = cli(*args).splitlines()
        seen += [line.split()[0] for line in lines[1:] if not line.startswith("next page")]
        if not lines[-1].startswith("next page: --after "):
            break
        args = ["runs", "-n", "2", "--after", lines[-1].split()[-1]]
    assert len(seen) == len(set(seen)) == len(holders)  # the re-add is answered by its holder


@postgres_only
def test_keys_go_page_by_page_with_after(holders, cli):
    """``durable keys -n 2`` ends with the next page's option (a key's cursor); following it lists
    keys taken earlier, never one twice, to the last page (no hint); a bad cursor is refused."""
    seen: list[str] = []
    args = ["keys", "-n", "2"]
    for _ in range(10):
        lines = cli(*args).splitlines()
        rows = lines[lines.index("") + 2 :]  # after the counts, a blank line and the heading
        seen += [line.split()[1] for line in rows if line.split()[0] in ("close", "once")]
        if not lines[-1].startswith("next page: --after "):
            break
        assert "a page of 2: --after for the next" in lines[-2]
        args = ["keys", "-n", "2", "--after", lines[-1].split()[-1]]
    assert len(seen) == len(set(seen)) == 6  # every key once: the six holders' (the re-add holds none)
    assert [
        json.loads(line)["key"] for line in cli("keys", "-w", "close", "-n", "9", "--json").splitlines()
    ] == [
        "100xxoff",
        "100%_off",
        "going:1",
        "done:1",
    ]
    refused = cli("keys", "--after", "not-a-cursor", code=1)
    assert "cursor of the last key of the page before" in refused
