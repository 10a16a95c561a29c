"""The admin and runs in bulk (issue 43): runs filtered by a tag (offered from the newest tagged
runs, any by URL) and by when they were created; a run's page shows its tags and the run it
was forked from."""

from __future__ import annotations

import html
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


def test_runs_by_tag_and_creation_and_a_forks_page(durable: Any) -> None:
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    wf = durable.workflow(f"tags_{uuid.uuid4().hex[:6]}")
    wf.step(lambda n: n, name="echo")
    mine = wf.start({"n": 1}, tags={"tenant": tenant})
    other = wf.start({"n": 2}, tags={"tenant": "someone-else"})
    assert durable.run_message(wf.name, 0, mine) == "completed"
    client = _admin_client()
    page = html.unescape(client.get(RUNS, {"workflow": wf.name}).content.decode())
    assert f"tenant={tenant}" in page and "By created" in page  # the tag offered, the date filter
    chosen = client.get(RUNS, {"workflow": wf.name, "tag": f"tenant={tenant}"})
    shown = chosen.content.decode()
    assert chosen.status_code == 200 and mine in shown and other not in shown
    forked = durable.fork(mine, "echo", key=None)
    run_page = html.unescape(client.get(f"{RUNS}{forked}/change/").content.decode())
    assert f"/admin/durable_celery/durablerun/{mine}/change/" in run_page  # forked from, linked
    assert f'"tenant": "{tenant}"' in run_page  # its tags, carried to the fork
