"""DjangoDurable's set-up: settings from ``CELERY_DURABLE_*``, the alias's database (followed to
another one when Django switches, as its test runner does), and a one-line refusal of an alias
that is not PostgreSQL on psycopg 3; Django's system checks for the dead ends of a first hour."""

from __future__ import annotations

import io
import uuid

import pytest
from celery import Celery

from durable_celery import NotConfigured, RunNotFound
from durable_celery.errors import SchemaOutdated
from tests.conftest import _admin


def test_celery_durable_settings_reach_durable(durable):
    assert durable.settings.poll_interval == 0.1  # CELERY_DURABLE_POLL_INTERVAL
    assert durable.settings.stale_lock_timeout == 5.0
    assert durable.alias == "default" and durable.join_atomic is True
    assert durable.db.is_postgres


@pytest.fixture
def another_durable():
    """``make(alias)``: a DjangoDurable on another alias, forgotten again after the test (the
    checks and the admin look at every DjangoDurable made)."""
    from durable_celery.contrib.django import durable as made

    before = dict(made._made)
    try:
        yield lambda alias: made.DjangoDurable(
            Celery(f"other-{alias}", broker="memory://", set_as_current=False), database_alias=alias
        )
    finally:
        made._made.clear()
        made._made.update(before)


def _check_lines() -> list[str]:
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    try:
        call_command("check", stdout=io.StringIO(), stderr=io.StringIO())
    except SystemCheckError as failed:
        return str(failed).splitlines()
    return []


def test_an_alias_that_is_not_postgresql_is_a_check_error_and_refused_at_first_use(durable, another_durable):
    """Guards issue 39: SQLite (startproject's default) is a system check's error with the fix,
    never an exception at import; the first use says the same in one line."""
    lite = another_durable("lite")  # creating it raises nothing: every manage.py command still runs
    lines = _check_lines()
    assert any(
        "durable_celery.E002" in line and "durable needs PostgreSQL" in line and "'lite'" in line
        for line in lines
    ), lines
    assert any("HINT" in line and "django.db.backends.postgresql" in line for line in lines), lines
    with pytest.raises(NotConfigured) as refused:
        lite.get_run("00000000-0000-0000-0000-000000000000")
    message = str(refused.value)
    assert "\n" not in message and "'lite'" in message and "fix: set DATABASES['lite']['ENGINE']" in message


def test_an_unknown_alias_lists_the_aliases_there_are(durable, another_durable):
    another_durable("nope")
    lines = _check_lines()
    assert any(
        "durable_celery.E002" in line and "'nope'" in line and "aliases: 'default', 'lite', 'replica'" in line
        for line in lines
    ), lines


def test_the_check_passes_when_all_is_well(durable):
    assert _check_lines() == []


def test_a_durable_without_its_app_in_installed_apps_is_a_check_error(durable):
    """Guards issue 39: without the app, migrate silently skips durable's tables."""
    from django.test import override_settings

    apps = [app for app in settings_module().INSTALLED_APPS if app != "durable_celery.contrib.django"]
    with override_settings(INSTALLED_APPS=apps):
        lines = _check_lines()
    assert any("durable_celery.E001" in line and "not in INSTALLED_APPS" in line for line in lines), lines
    assert any("HINT: add 'durable_celery.contrib.django' to INSTALLED_APPS" in line for line in lines), lines


def settings_module():
    from django.conf import settings

    return settings


def test_a_start_inside_atomic_on_an_unmigrated_database_raises_schema_outdated(durable, pg_template):
    """Guards issue 39: the raw ``ProgrammingError ... relation "durable_keys" does not exist``
    becomes SchemaOutdated, whose fix names manage.py migrate (the app is installed here)."""
    from django.db import connections, transaction

    from tests.django.shop.workflows import fulfil

    settings = connections["default"].settings_dict
    home, empty = settings["NAME"], f"durable_t_dj_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f"CREATE DATABASE {empty}")
    try:
        connections["default"].close()
        settings["NAME"] = empty
        with pytest.raises(SchemaOutdated) as outdated, transaction.atomic():
            fulfil.start({"order_id": 1}, key="unmigrated")
        assert "run `python manage.py migrate`" in str(outdated.value)
        with pytest.raises(SchemaOutdated) as outside:  # on durable's own pool: the same fix
            fulfil.start({"order_id": 1}, key="unmigrated")
        assert outside.value.fix == "run `python manage.py migrate`"
    finally:
        connections["default"].close()
        settings["NAME"] = home
        durable.db.engine.dispose()
        with _admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {empty} WITH (FORCE)")


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


def test_a_starting_worker_logs_the_check_errors_one_line_each(durable, caplog):
    """Guards issue 39: Celery runs Django's checks in a worker but drops what they say."""
    import logging

    from celery import signals
    from django.test import override_settings

    from durable_celery.contrib.django import checks

    connected = [entry for entry in signals.worker_init.receivers if entry[0][0] == checks.ALIAS]
    assert len(connected) == 1  # by DjangoDurable, once however many are made
    apps = [app for app in settings_module().INSTALLED_APPS if app != "durable_celery.contrib.django"]
    with override_settings(INSTALLED_APPS=apps), caplog.at_level(logging.ERROR, "durable_celery"):
        checks.log_at_worker_start(sender=None)
    said = [r.getMessage() for r in caplog.records if r.name == "durable_celery"]
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith("durable: DjangoDurable is set up but 'durable_celery.contrib.django'")
    assert "; fix: add 'durable_celery.contrib.django' to INSTALLED_APPS" in said[0]
