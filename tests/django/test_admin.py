"""Durable in the Django admin, driven with Django's Client: runs listed, filtered and searched,
a run's steps and key activity on its page, the actions calling durable's API (cancel, retry,
rerun, release keys) with their errors shown, nothing written through the models, and the
actions refused to a user without the change permission. Steps run in this thread through
``durable.run_message``, as a worker would run them. The admin reads well: durations, tracebacks
as text, "View run" titles, short ids and keys, release messages naming the key, and whether each
key blocks a new start."""

from __future__ import annotations

import html
import re
import uuid
from typing import Any

import pytest

from durable_celery.errors import InvalidArgument

RUNS = "/admin/durable_celery/durablerun/"
KEYS = "/admin/durable_celery/durablekey/"

# Tags whose run fails in step ``explode`` (the retry test heals one before retrying).
_broken: set[str] = set()


@pytest.fixture(scope="module")
def flows(django_project: Any) -> Any:
    """This module's workflows: ``ok`` completes, ``boom`` fails while its tag is broken (both
    keyed by tag), ``plain`` has no key."""
    durable = django_project
    suffix = uuid.uuid4().hex[:6]
    ok = durable.workflow(f"admin_ok_{suffix}", key="ok:{tag}")

    @ok.step
    def finish(tag):
        return {"tag": tag}

    boom = durable.workflow(f"admin_boom_{suffix}", key="boom:{tag}")

    @boom.step
    def explode(tag):
        if tag in _broken:
            raise RuntimeError(f"boom {tag}")
        return {"tag": tag}

    plain = durable.workflow(f"admin_plain_{suffix}")  # no key

    @plain.step
    def just(tag):
        return tag

    kept = {}
    for reuse in ("after_failure", "never"):  # keyed like boom: fail while their tag is broken
        kept[reuse] = durable.workflow(f"admin_{reuse}_{suffix}", key="kept:{tag}", reuse=reuse)
        kept[reuse].step(explode)

    class Flows:
        pass

    flows = Flows()
    flows.ok, flows.boom, flows.plain = ok, boom, plain  # type: ignore[attr-defined]
    flows.after_failure, flows.never = kept["after_failure"], kept["never"]  # type: ignore[attr-defined]
    return flows


def _tag() -> str:
    return uuid.uuid4().hex[:10]


def _pending(workflow: Any, tag: str | None = None) -> str:
    return str(workflow.start({"tag": tag or _tag()}))


def _completed(durable: Any, flows: Any, tag: str | None = None) -> str:
    run_id = _pending(flows.ok, tag)
    assert durable.run_message(flows.ok.name, 0, run_id) == "completed"
    return run_id


def _failed(durable: Any, flows: Any) -> tuple[str, str]:
    tag = _tag()
    _broken.add(tag)
    run_id = _pending(flows.boom, tag)
    durable.run_message(flows.boom.name, 0, run_id)
    assert durable.get_run(run_id).status == "failed"
    return run_id, tag


def _finished(durable: Any, workflow: Any, *, fail: bool = False) -> str:
    """A run of a workflow whose step is ``explode``: completed, or failed when ``fail``."""
    tag = _tag()
    if fail:
        _broken.add(tag)
    run_id = _pending(workflow, tag)
    durable.run_message(workflow.name, 0, run_id)
    assert durable.get_run(run_id).status == ("failed" if fail else "completed")
    return run_id


def _user(*, superuser: bool = False, perms: tuple[str, ...] = ()) -> Any:
    from django.contrib.auth.models import Permission, User

    name = f"admin-{uuid.uuid4().hex[:10]}"
    if superuser:
        return User.objects.create_superuser(name, f"{name}@example.com", "pw")
    user = User.objects.create_user(name, f"{name}@example.com", "pw", is_staff=True)
    for codename in perms:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="durable_celery", codename=codename)
        )
    return user


def _client(user: Any) -> Any:
    from django.test import Client

    client = Client()
    client.force_login(user)
    client.username = user.get_username()
    return client


@pytest.fixture
def admin(durable: Any) -> Any:
    """A Client logged in as a new superuser."""
    return _client(_user(superuser=True))


@pytest.fixture
def viewer(durable: Any) -> Any:
    """A Client logged in as a new staff user who may view durable's models, not change them."""
    views = ("view_durablerun", "view_durablekey", "view_durablestep", "view_durableactivity")
    return _client(_user(perms=views))


def _page(response: Any) -> str:
    assert response.status_code == 200, response.status_code
    return html.unescape(response.content.decode())


def _act(client: Any, url: str, action: str, *ids: str) -> Any:
    """POST an action on the changelist, as its form does, and follow the redirect back."""
    return client.post(url, {"action": action, "_selected_action": list(ids), "index": "0"}, follow=True)


def _row(page: str, row_id: str) -> str:
    """The list's row that links to the page of row ``row_id``."""
    (row,) = [r for r in page.split("<tr")[1:] if f"/{row_id}/change/" in r]
    return row.split("</tr>")[0]


def _cell(row: str, column: str) -> str:
    """A column's text in a list row (tags dropped)."""
    found = re.search(rf'<t[dh] class="field-{column}[^"]*">(.*?)</t[dh]>', row, re.S)
    assert found, f"no column {column} in {row}"
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


NOWRAP = 'style="white-space: nowrap"'
DURATION = re.compile(r"^(\d+ ms|\d\.\d s|\d+ s|\d+ min( \d+ s)?)$")


# -- lists ------------------------------------------------------------------------------------


def test_the_run_list_filters_by_workflow_and_status_and_searches_key_and_id(durable, flows, admin):
    done_tag = _tag()
    done = _completed(durable, flows, done_tag)
    waiting = _pending(flows.ok)
    failed, _ = _failed(durable, flows)

    page = _page(admin.get(RUNS))
    assert all(run_id in page for run_id in (done, waiting, failed))
    for column in ("Workflow", "Key", "Status", "Step", "Queued", "Running", "Total", "Created"):
        assert column in page
    for action in ("cancel_runs", "retry_runs", "rerun_runs", "release_keys"):
        assert f'<option value="{action}">' in page

    ok_runs = _page(admin.get(RUNS, {"workflow": flows.ok.name}))
    assert done in ok_runs and waiting in ok_runs and failed not in ok_runs
    completed = _page(admin.get(RUNS, {"workflow": flows.ok.name, "status": "completed"}))
    assert done in completed and waiting not in completed
    assert failed in _page(admin.get(RUNS, {"status": "failed"}))

    by_key = _page(admin.get(RUNS, {"q": f"ok:{done_tag}"}))
    assert done in by_key and waiting not in by_key
    by_id = _page(admin.get(RUNS, {"q": waiting}))
    assert waiting in by_id and done not in by_id
    exact_key = _page(admin.get(RUNS, {"key": f"ok:{done_tag}"}))  # each key in the list links so
    assert done in exact_key and waiting not in exact_key


def test_the_key_filter_tells_held_released_and_keyless_runs(durable, flows, admin):
    held = _completed(durable, flows)
    released = _completed(durable, flows)
    durable.release_key(released, by="test")
    keyless = _pending(flows.plain)
    assert durable.get_run(keyless).key is None
    only_ok = {"workflow": flows.ok.name}

    holding = _page(admin.get(RUNS, {**only_ok, "key_is": "holding"}))
    assert held in holding and released not in holding
    not_holding = _page(admin.get(RUNS, {**only_ok, "key_is": "released"}))
    assert released in not_holding and held not in not_holding
    assert held not in _page(admin.get(RUNS, {**only_ok, "key_is": "none"}))
    assert keyless in _page(admin.get(RUNS, {"workflow": flows.plain.name, "key_is": "none"}))
    assert keyless not in _page(admin.get(RUNS, {"workflow": flows.plain.name, "key_is": "holding"}))


def test_the_key_list_shows_holders_and_searches_keys(durable, flows, admin):
    tag = _tag()
    run_id = _completed(durable, flows, tag)
    page = _page(admin.get(KEYS))
    assert f"ok:{tag}" in page and run_id in page
    found = _page(admin.get(KEYS, {"q": f"ok:{tag}"}))
    assert run_id in found and "completed" in found
    assert run_id in _page(admin.get(KEYS, {"workflow": flows.ok.name}))
    assert run_id in _page(admin.get(f"{KEYS}{run_id}/change/"))


# -- a run's page -----------------------------------------------------------------------------


def test_a_runs_page_shows_its_steps_and_key_activity_read_only(durable, flows, admin):
    tag = _tag()
    run_id = _completed(durable, flows, tag)
    durable.release_key(run_id, by="ops-person")
    page = _page(admin.get(f"{RUNS}{run_id}/change/"))
    assert run_id in page and flows.ok.name in page and f"ok:{tag}" in page
    assert "finish" in page and "completed" in page  # the step attempt
    assert "key_released" in page and "ops-person" in page  # the key activity
    assert f'"tag": "{tag}"' in page  # input and output, as JSON
    assert 'name="_save"' not in page and "/delete/" not in page
    assert "/runs/" not in page  # no dashboard configured


def test_a_runs_page_links_to_the_dashboard_when_configured(durable, flows, admin):
    from django.test import override_settings

    run_id = _pending(flows.ok)
    with override_settings(CELERY_DURABLE_DASHBOARD_URL="https://ops.example/durable/"):
        page = _page(admin.get(f"{RUNS}{run_id}/change/"))
    assert f'href="https://ops.example/durable/runs/{run_id}"' in page


def test_there_is_no_add_change_or_delete(durable, flows, admin):
    run_id = _pending(flows.ok)
    assert admin.get(f"{RUNS}add/").status_code == 403
    assert admin.get(f"{RUNS}{run_id}/delete/").status_code == 403
    assert admin.post(f"{RUNS}{run_id}/change/", {"status": "completed"}).status_code == 403
    assert admin.get(f"{KEYS}add/").status_code == 403
    page = _page(admin.get(RUNS))
    assert f"{RUNS}add/" not in page and "delete_selected" not in page
    assert durable.get_run(run_id).status == "pending"


# -- reading well -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (None, "-"),
        (0, "0 ms"),
        (0.35, "350 ms"),
        (1.23, "1.2 s"),
        (9.96, "10 s"),
        (42.4, "42 s"),
        (59.6, "1 min"),
        (184, "3 min 4 s"),
        (7500, "2 h 5 min"),
        (3 * 86400 + 4 * 3600 + 59, "3 d 4 h"),
    ],
)
def test_durations_read_as_people_say_them(django_project, seconds, shown):
    from durable_celery.contrib.django.admin import human_duration

    assert human_duration(seconds) == shown


def test_runs_and_steps_show_how_long_they_queued_and_ran(durable, flows, admin):
    from django.utils.timezone import localtime

    from durable_celery.contrib.django.models import DurableRun, DurableStep

    done, waiting = _completed(durable, flows), _pending(flows.ok)
    row = DurableRun.objects.get(pk=done)
    assert row.queued_seconds == (row.started_at - row.created_at).total_seconds()
    assert row.running_seconds == (row.finished_at - row.started_at).total_seconds()
    assert row.total_seconds == (row.finished_at - row.created_at).total_seconds()
    pending = DurableRun.objects.get(pk=waiting)
    assert pending.running_seconds is None  # not started: queued and total count to now
    assert 0 < pending.queued_seconds == pytest.approx(pending.total_seconds, abs=1)
    step = DurableStep.objects.get(run_id=done)
    assert step.running_seconds == (step.finished_at - step.started_at).total_seconds()

    page = _page(admin.get(RUNS, {"workflow": flows.ok.name}))
    for column in ("queued", "running", "total"):
        assert DURATION.match(_cell(_row(page, done), column)), _cell(_row(page, done), column)
    assert _cell(_row(page, waiting), "running") == "-"
    assert DURATION.match(_cell(_row(page, waiting), "total"))
    assert _cell(_row(page, done), "step") == "finish"  # its attempt shown from the second on
    assert _cell(_row(page, done), "short_id") == f"…{done[-6:]}"  # time-ordered ids differ at the end
    assert f'title="{done}"' in _row(page, done)  # the whole id in the tooltip
    created = localtime(row.created_at).strftime("%Y-%m-%d %H:%M:%S")
    assert _cell(_row(page, done), "created") == created  # in the project's TIME_ZONE

    run_page = _page(admin.get(f"{RUNS}{done}/change/"))
    for label in ("Queued:", "Running:", "Total:"):
        assert label in run_page
    for moment in (row.created_at, row.started_at, row.finished_at):  # to the second
        date, time = localtime(moment).strftime("%Y-%m-%d %H:%M:%S").split()
        assert f"{date}</span> <span {NOWRAP}>{time}</span>" in run_page
    steps = _page(admin.get("/admin/durable_celery/durablestep/", {"q": done}))
    assert DURATION.match(_cell(_row(steps, str(step.pk)), "running"))


def test_a_long_key_is_cut_short_in_the_lists_and_wraps_after_its_colons(durable, flows, admin):
    tag = "eu-west:" + "x" * 60
    run_id = _completed(durable, flows, tag)
    for url in (RUNS, KEYS):
        row = _row(_page(admin.get(url, {"workflow": flows.ok.name})), run_id)
        assert f'title="ok:{tag}"' in row  # the whole key in the tooltip
        assert _cell(row, "key_link" if url == RUNS else "short_key") == f"ok:{tag[:28]}…"
        assert f"ok:</span><wbr><span {NOWRAP}>eu-west:</span><wbr><span {NOWRAP}>xxx" in row


def test_a_retried_runs_step_shows_its_attempt(durable, flows, admin):
    run_id, tag = _failed(durable, flows)
    durable.retry(run_id)
    durable.run_message(flows.boom.name, 0, run_id)  # fails again, attempt 2
    row = _row(_page(admin.get(RUNS, {"workflow": flows.boom.name})), run_id)
    assert _cell(row, "step") == "explode, attempt 2"


def test_a_failed_runs_error_reads_as_text_with_its_traceback(durable, flows, admin):
    run_id, tag = _failed(durable, flows)
    top = f"RuntimeError: boom {tag}\n\nTraceback (most recent call last):\n"
    run_page = _page(admin.get(f"{RUNS}{run_id}/change/"))
    assert re.search(r"<pre[^>]*>" + re.escape(top), run_page), "the run's error, traceback below"
    assert 'raise RuntimeError(f"boom {tag}")' in run_page  # the traceback's source lines
    assert '"traceback":' not in run_page and "\\n" not in run_page  # no escaped JSON
    assert re.search(rf'<td class="field-short_error">\s*<p>RuntimeError: boom {tag}</p>', run_page)

    from durable_celery.contrib.django.models import DurableStep

    step_id = DurableStep.objects.get(run_id=run_id).pk
    step_page = _page(admin.get(f"/admin/durable_celery/durablestep/{step_id}/change/"))
    assert re.search(r"<pre[^>]*>" + re.escape(top), step_page), "the step's error, traceback below"
    assert "<h1>View step</h1>" in step_page


def test_an_error_without_traceback_shows_its_details(durable, flows, admin):
    tag = _tag()
    first = _pending(flows.ok, tag)
    second = str(flows.ok.start({"tag": tag}, on_duplicate="cancel_existing"))
    page = _page(admin.get(f"{RUNS}{first}/change/"))
    assert re.search(rf"<pre[^>]*>Cancelled: replaced by run {second}\nreplaced_by: {second}</pre>", page)


@pytest.mark.parametrize(
    ("url", "title"),
    [
        (RUNS, "View runs"),
        (KEYS, "View keys"),
        ("/admin/durable_celery/durablestep/", "View steps"),
        ("/admin/durable_celery/durableactivity/", "View activity"),
        ("/admin/durable_celery/durableschedule/", "View schedules"),
    ],
)
def test_the_lists_are_titled_view_not_select_to_change(durable, admin, url, title):
    page = _page(admin.get(url))
    assert f"<h1>{title}</h1>" in page and f"<title>{title} |" in page
    assert "to change" not in page


def test_a_runs_page_is_titled_view_run(durable, flows, admin, viewer):
    run_id = _completed(durable, flows)
    for client in (admin, viewer):
        page = _page(client.get(f"{RUNS}{run_id}/change/"))
        assert "<h1>View run</h1>" in page and "Change run" not in page
    key_page = _page(admin.get(f"{KEYS}{run_id}/change/"))
    assert "<h1>View key</h1>" in key_page


def test_the_key_list_says_whether_each_key_blocks_a_new_start(durable, flows, admin, monkeypatch):
    cases = [  # the workflow's reuse and the holder's status decide
        (flows.ok, _completed(durable, flows), "no"),  # after_close: a finished holder frees it
        (flows.ok, _pending(flows.ok), "yes"),  # an unfinished holder always blocks
        (flows.after_failure, _finished(durable, flows.after_failure), "yes"),
        (flows.after_failure, _finished(durable, flows.after_failure, fail=True), "no"),
        (flows.never, _finished(durable, flows.never, fail=True), "yes"),
    ]
    for workflow, run_id, blocks in cases:
        row = _row(_page(admin.get(KEYS, {"workflow": workflow.name})), run_id)
        assert _cell(row, "blocks") == blocks, (workflow.name, run_id)
    assert "Blocks a new start" in _page(admin.get(KEYS))

    monkeypatch.delitem(durable.workflows, flows.ok.name)  # a workflow this process does not define
    row = _row(_page(admin.get(KEYS, {"workflow": flows.ok.name})), cases[0][1])
    assert _cell(row, "blocks") == "unknown"


# -- actions ----------------------------------------------------------------------------------


def test_cancel_runs_cancels_a_pending_run_and_says_so_of_a_finished_one(durable, flows, admin):
    pending, done = _pending(flows.ok), _completed(durable, flows)
    page = _page(_act(admin, RUNS, "cancel_runs", pending, done))
    assert durable.get_run(pending).status == "cancelled"
    assert durable.get_run(done).status == "completed"
    assert f"Run {pending}: cancelled." in page
    assert f"Run {done}: had finished already, not cancelled." in page


def test_retry_runs_resumes_a_failed_run(durable, flows, admin):
    run_id, tag = _failed(durable, flows)
    page = _page(_act(admin, RUNS, "retry_runs", run_id))
    assert f"Run {run_id}: retried from its failed step." in page
    assert durable.get_run(run_id).status in ("pending", "running")
    _broken.discard(tag)
    assert durable.run_message(flows.boom.name, 0, run_id) == "completed"
    assert durable.get_run(run_id).output == {"tag": tag}


def test_retry_runs_shows_why_a_run_cannot_be_retried(durable, flows, admin):
    pending = _pending(flows.ok)
    page = _page(_act(admin, RUNS, "retry_runs", pending))
    assert f"Run {pending}: NotFinished:" in page
    assert durable.get_run(pending).status == "pending"


def test_rerun_runs_starts_a_new_run_of_a_finished_one(durable, flows, admin):
    tag = _tag()
    done = _completed(durable, flows, tag)
    page = _page(_act(admin, RUNS, "rerun_runs", done))
    (fresh,) = [r.id for r in durable.list_runs(workflow=flows.ok.name, key=f"ok:{tag}") if r.id != done]
    assert f'Run {done}: rerun as <a href="{RUNS}{fresh}/change/">{fresh}</a>.' in page
    run = durable.get_run(fresh)
    assert run.status == "pending" and run.input == {"tag": tag} and run.holds_key


def test_rerun_runs_shows_key_taken(durable, flows, admin):
    tag = _tag()
    done = _completed(durable, flows, tag)
    newer = _pending(flows.ok, tag)  # takes the finished run's key
    page = _page(_act(admin, RUNS, "rerun_runs", done))
    assert f"Run {done}: KeyTaken: key is held by run {newer}" in page
    assert [r.id for r in durable.list_runs(workflow=flows.ok.name, key=f"ok:{tag}")] == [newer, done]


def test_release_keys_frees_a_finished_runs_key_and_shows_why_not_otherwise(durable, flows, admin):
    done, pending = _completed(durable, flows), _pending(flows.ok)
    released = _completed(durable, flows)
    durable.release_key(released, by="test")
    page = _page(_act(admin, RUNS, "release_keys", done, pending, released))
    key_of = {
        run_id: f"key '{durable.get_run(run_id).key}' of workflow {flows.ok.name}"
        for run_id in (done, pending, released)
    }
    assert f"Run {done}: released {key_of[done]}." in page
    assert f"Run {pending}: {key_of[pending]} not released: NotFinished: run {pending} is pending" in page
    assert f"Run {released}: {key_of[released]} not released: NoKey:" in page
    assert not durable.get_run(done).holds_key and durable.get_run(pending).holds_key
    (entry,) = durable.activity(kinds="key_released", run_id=done)
    assert entry.details["by"] == f"django admin: {admin.username}"  # who released it is recorded


def test_release_keys_from_the_key_list(durable, flows, admin):
    tag = _tag()
    done = _completed(durable, flows, tag)
    page = _page(_act(admin, KEYS, "release_keys", done))
    assert f"Run {done}: released key 'ok:{tag}' of workflow {flows.ok.name}." in page
    assert not durable.get_run(done).holds_key


# -- without the change permission ------------------------------------------------------------


def test_a_viewer_sees_the_runs_but_gets_no_action(durable, flows, viewer):
    pending, done = _pending(flows.ok), _completed(durable, flows)
    page = _page(viewer.get(RUNS))
    assert pending in page and done in page
    for action in ("cancel_runs", "retry_runs", "rerun_runs", "release_keys"):
        assert action not in page
    run_page = _page(viewer.get(f"{RUNS}{done}/change/"))
    assert done in run_page and "finish" in run_page and 'name="_save"' not in run_page
    assert done in _page(viewer.get(KEYS)) and "release_keys" not in _page(viewer.get(KEYS))

    for url, action, run_id in (
        (RUNS, "cancel_runs", pending),
        (RUNS, "release_keys", done),
        (KEYS, "release_keys", done),
    ):
        refused = _page(_act(viewer, url, action, run_id))
        assert f"Run {run_id}:" not in refused  # no action ran: the list is shown again
    assert durable.get_run(pending).status == "pending"
    assert durable.get_run(done).holds_key


def test_a_staff_user_without_view_permission_sees_no_runs(durable, flows):
    client = _client(_user())
    assert client.get(RUNS).status_code == 403


# -- the models -------------------------------------------------------------------------------


def test_the_models_read_runs_as_durable_does(durable, flows):
    from durable_celery.contrib.django.models import DurableKey, DurableRun

    tag = _tag()
    run_id = _completed(durable, flows, tag)
    row, run = DurableRun.objects.get(pk=run_id), durable.get_run(run_id)
    for name in ("id", "workflow", "status", "input", "context", "output", "error", "key", "attempt"):
        assert getattr(row, name) == getattr(run, name), name
    assert row.input == {"tag": tag} and isinstance(row.input, dict)
    assert row.created_at == run.created_at and row.created_at.tzinfo is not None
    assert row.finished_at == run.finished_at and row.holds_key is True
    assert [s.name for s in row.steps.all()] == ["finish"]
    key = DurableKey.objects.get(workflow=flows.ok.name, key=f"ok:{tag}")
    assert key.holder == row and row.held_key == key


def test_the_models_refuse_every_write(durable, flows):
    from durable_celery.contrib.django.models import DurableKey, DurableRun, DurableStep

    run_id = _completed(durable, flows)
    row = DurableRun.objects.get(pk=run_id)
    writes = [
        lambda: DurableRun.objects.create(id=str(uuid.uuid4()), workflow="x", status="pending"),
        lambda: DurableRun.objects.get_or_create(id=run_id),
        lambda: DurableRun.objects.update_or_create(id=run_id, defaults={"status": "failed"}),
        lambda: DurableRun.objects.bulk_create([DurableRun(id="x")]),
        lambda: DurableRun.objects.bulk_update([row], ["status"]),
        lambda: DurableRun.objects.filter(pk=run_id).update(status="failed"),
        lambda: DurableRun.objects.filter(pk=run_id).delete(),
        lambda: DurableRun.objects.all().delete(),
        row.save,
        row.delete,
        lambda: DurableStep.objects.filter(run_id=run_id).delete(),
        lambda: DurableKey.objects.get(holder_id=run_id).delete(),
        lambda: DurableKey.objects.filter(holder_id=run_id).update(key="y"),
    ]
    for write in writes:
        with pytest.raises(InvalidArgument, match="read-only .* durable API"):
            write()
    run = durable.get_run(run_id)
    assert run.status == "completed" and run.holds_key and len(durable.list_steps(run_id)) == 1
