"""The admin's actions on "all N matching" (issue 43): Django's "select all" goes durable's bulk
path when the changelist's filters are bulk's (workflow, status, tag, created): every matching
run is acted on, not only the page's, with one ``bulk`` activity entry naming the admin user,
the filter and the counts, and each run's own entry naming the bulk action. A search has no bulk
twin: the action then goes row by row over the matching rows, with no bulk entry."""

from __future__ import annotations

import html
import uuid
from datetime import timedelta
from typing import Any

import pytest

RUNS = "/admin/durable_celery/durablerun/"

_broken: set[str] = set()  # tags whose run fails in step ``charge``


@pytest.fixture(scope="module")
def charges(django_project: Any) -> Any:
    """A workflow whose step fails while its tag is broken."""
    flow = django_project.workflow(f"admin_bulk_{uuid.uuid4().hex[:6]}")

    @flow.step
    def charge(tag):
        if tag in _broken:
            raise RuntimeError(f"provider down for {tag}")
        return {"charged": tag}

    return flow


def _admin() -> Any:
    from django.contrib.auth.models import User
    from django.test import Client

    user = User.objects.create_superuser(f"bulk-{uuid.uuid4().hex[:8]}", "root@example.com", "x")
    client = Client()
    client.force_login(user)
    client.username = user.get_username()
    return client


def _failed(durable: Any, flow: Any, tenant: str) -> str:
    tag = uuid.uuid4().hex[:10]
    _broken.add(tag)
    run_id = str(flow.start({"tag": tag}, tags={"tenant": tenant}))
    durable.run_message(flow.name, 0, run_id)
    assert durable.get_run(run_id).status == "failed"
    return run_id


def _select_all(client: Any, query: dict[str, str], action: str, shown: list[str]) -> str:
    """POST ``action`` with "select all N matching", from the changelist filtered by ``query``."""
    from django.utils.http import urlencode

    form = {"action": action, "select_across": "1", "index": "0", "_selected_action": shown}
    response = client.post(f"{RUNS}?{urlencode(query)}", form, follow=True)
    assert response.status_code == 200
    return html.unescape(response.content.decode())


def _bulk_entries(durable: Any, workflow: str) -> list[Any]:
    return [
        entry for entry in durable.activity(kinds="bulk", workflow=workflow) if not entry.details["dry_run"]
    ]


def test_retry_all_matching_goes_the_bulk_path_with_the_changelists_filters(durable, charges):
    tenant, other = f"acme-{uuid.uuid4().hex[:6]}", f"other-{uuid.uuid4().hex[:6]}"
    mine = [_failed(durable, charges, tenant) for _ in range(3)]
    theirs = _failed(durable, charges, other)
    client = _admin()
    since = (durable.get_run(mine[0]).created_at - timedelta(minutes=1)).isoformat(sep=" ")
    query = {
        "workflow": charges.name,
        "status": "failed",
        "tag": f"tenant={tenant}",
        "created_at__gte": since,
    }
    # The page shows one row; "all 3 matching" acts on every matching run.
    page = _select_all(client, query, "retry_runs", mine[:1])
    for run_id in mine:
        assert durable.get_run(run_id).status in ("pending", "running")
    assert durable.get_run(theirs).status == "failed"  # another tenant's: not matched
    (entry,) = _bulk_entries(durable, charges.name)
    assert entry.details["matched"] == 3 and entry.details["acted"] == 3
    assert entry.details["by"] == f"django admin: {client.username}"
    assert entry.details["filter"]["tags"] == {"tenant": tenant}
    assert entry.details["filter"]["statuses"] == ["failed"] and entry.details["filter"]["since"]
    assert f"Bulk retry {entry.details['bulk']}: 3 matched, acted on 3" in page
    retried = durable.activity(run_id=mine[1])
    assert any(f"bulk {entry.details['bulk']}" in str(e.details) for e in retried)  # its history names it


def test_a_search_has_no_bulk_twin_so_the_action_goes_row_by_row(durable, charges):
    tenant = f"solo-{uuid.uuid4().hex[:6]}"
    run_id = _failed(durable, charges, tenant)
    before = len(_bulk_entries(durable, charges.name))
    page = _select_all(_admin(), {"workflow": charges.name, "q": run_id}, "retry_runs", [run_id])
    assert f"Run {run_id}: retried from its failed step." in page
    assert durable.get_run(run_id).status in ("pending", "running")
    assert len(_bulk_entries(durable, charges.name)) == before


def test_cancel_all_matching_without_a_filter_is_refused_and_writes_nothing(durable, charges):
    pending = str(charges.start({"tag": uuid.uuid4().hex[:10]}))
    page = _select_all(_admin(), {}, "cancel_runs", [pending])
    assert "InvalidArgument: a bulk action needs a filter" in page
    assert durable.get_run(pending).status == "pending"
