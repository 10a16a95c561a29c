"""DjangoDurable's set-up: settings from ``CELERY_DURABLE_*``, the alias's database (followed to
another one when Django switches, as its test runner does), and a one-line refusal of an alias
that is not PostgreSQL on psycopg 3."""

from __future__ import annotations

import uuid

import pytest
from celery import Celery

from durable_celery import NotConfigured, RunNotFound
from tests.conftest import _admin


def test_celery_durable_settings_reach_durable(durable):
    assert durable.settings.poll_interval == 0.1  # CELERY_DURABLE_POLL_INTERVAL
    assert durable.settings.stale_lock_timeout == 5.0
    assert durable.alias == "default" and durable.join_atomic is True
    assert durable.db.is_postgres


def test_an_alias_that_is_not_postgresql_is_refused_in_one_line(durable):
    from durable_celery.contrib.django import DjangoDurable

    app = Celery("lite", broker="memory://", set_as_current=False)
    with pytest.raises(NotConfigured) as refused:
        DjangoDurable(app, database_alias="lite")
    message = str(refused.value)
    assert "\n" not in message and "'lite'" in message and "postgresql" in message


def test_the_database_follows_the_alias_to_another_database(durable, pg_template):
    from django.db import connections

    from tests.django.shop.workflows import fulfil

    settings = connections["default"].settings_dict
    home, other = settings["NAME"], f"durable_t_dj_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f"CREATE DATABASE {other} TEMPLATE {pg_template}")
    try:
        connections["default"].close()
        settings["NAME"] = other  # what Django's test runner does with the test database
        assert durable.db.engine.url.database == other
        run_id = fulfil.start({"order_id": 1}, key=f"moved-{uuid.uuid4().hex[:6]}")
        assert durable.get_run(run_id).status == "pending"
    finally:
        connections["default"].close()
        settings["NAME"] = home
        assert durable.db.engine.url.database == home
        with _admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {other} WITH (FORCE)")
    with pytest.raises(RunNotFound):  # it was written to the other database, not this one
        durable.get_run(run_id)
