"""The admin's lists at volume (issue 42): the paginator counts at most ``COUNT_CAP + 1`` rows,
the filters offer values from a bounded read (or fixed ones), and runs go newest first by id."""

from __future__ import annotations

import uuid
from typing import Any

RUNS = "/admin/durable_celery/durablerun/"


def _admin_client() -> Any:
    from django.contrib.auth.models import User
    from django.test import Client

    user = User.objects.create_superuser(f"root-{uuid.uuid4().hex[:8]}", "root@example.com", "x")
    client = Client()
    client.force_login(user)
    return client


def test_the_run_list_counts_up_to_the_cap_and_offers_bounded_filters(durable: Any, monkeypatch: Any) -> None:
    wf = durable.workflow(f"volume_{uuid.uuid4().hex[:6]}")
    wf.step(lambda: None, name="only")
    started = [wf.start() for _ in range(4)]
    from durable_celery.contrib.django import admin_filters

    monkeypatch.setattr(admin_filters, "COUNT_CAP", 2)
    response = _admin_client().get(RUNS, {"workflow": wf.name})
    assert response.status_code == 200
    page = response.content.decode()
    paginator = page[page.index('class="paginator"') :]
    assert paginator.split("</p>")[0].split(">")[-1].strip().startswith("3 ")  # up to the cap + 1
    assert page.index(started[3]) < page.index(started[2]) < page.index(started[1])  # newest first, by id
    assert f"?workflow={wf.name}" in page and "?status=compensation_failed" in page
