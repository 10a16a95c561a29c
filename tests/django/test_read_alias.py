"""``CELERY_DURABLE_READ_DATABASE_ALIAS`` (issue 42): the admin reads durable's rows on the read
replica's alias, its actions write through the DjangoDurable of the primary, and a read alias
durable cannot use is a system check's error. The test project's ``replica`` alias reads the
same database (a mirror), so the reads are told apart by the connection that made them; the
plain ``Durable``'s test (tests/integration/store/test_read_replica.py) uses a real standby."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

RUNS = "/admin/durable_celery/durablerun/"


@pytest.fixture
def reading(durable: Any) -> Iterator[Any]:
    """A DjangoDurable on ``default`` reading ``replica``, and the setting the models read; the
    DjangoDurables made before are restored after."""
    from django.test import override_settings

    from durable_celery.contrib.django import durable as made

    before, before_reading = dict(made._made), dict(made._reading)
    app = Celery(f"reading-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    try:
        with override_settings(CELERY_DURABLE_READ_DATABASE_ALIAS="replica"):
            yield made.DjangoDurable(app, read_database_alias="replica", upkeep=False)
    finally:
        made._made.clear()
        made._made.update(before)
        made._reading.clear()
        made._reading.update(before_reading)


def _superuser() -> Any:
    from django.contrib.auth.models import User
    from django.test import Client

    user = User.objects.create_superuser(f"root-{uuid.uuid4().hex[:8]}", "root@example.com", "x")
    client = Client()
    client.force_login(user)
    return client


def test_the_admin_reads_the_replica_alias_and_acts_on_the_primary(durable: Any, reading: Any) -> None:
    from django.db import connections
    from django.test.utils import CaptureQueriesContext

    wf = durable.workflow(f"read_alias_{uuid.uuid4().hex[:6]}")
    wf.step(lambda n: n, name="echo")
    done, pending = wf.start({"n": 1}), wf.start({"n": 2})
    assert durable.run_message(wf.name, 0, done) == "completed"
    assert reading.reads.alias == "replica" and reading.db.alias == "default"
    client = _superuser()
    with (
        CaptureQueriesContext(connections["replica"]) as on_replica,
        CaptureQueriesContext(connections["default"]) as on_primary,
    ):
        page = client.get(RUNS, {"workflow": wf.name})
    assert page.status_code == 200 and done in page.content.decode() and pending in page.content.decode()
    assert any("durable_runs" in q["sql"] for q in on_replica.captured_queries)
    assert not any("durable_runs" in q["sql"] for q in on_primary.captured_queries)  # sessions, users only
    acted = client.post(
        RUNS, {"action": "cancel_runs", "_selected_action": [pending], "index": "0"}, follow=True
    )
    assert acted.status_code == 200 and f"Run {pending}" in acted.content.decode()
    assert durable.get_run(pending).status == "cancelled"  # written on the primary


def test_a_read_alias_durable_cannot_use_is_a_check_error(durable: Any) -> None:
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    from durable_celery.contrib.django import durable as made

    before = dict(made._made)
    try:
        made.DjangoDurable(
            Celery("lite-reads", broker="memory://", set_as_current=False), read_database_alias="lite"
        )
        with pytest.raises(SystemCheckError) as failed:
            call_command("check", stdout=io.StringIO(), stderr=io.StringIO())
        assert "durable_celery.E002" in str(failed.value) and "'lite'" in str(failed.value)
    finally:
        made._made.clear()
        made._made.update(before)
        made._reading.pop("lite", None)
