"""Workflow definitions and input validation: no servers needed."""

from __future__ import annotations

import pytest
from celery import Celery

from durable_celery import (
    Durable,
    InvalidDefinition,
    InvalidKey,
    InvalidStart,
    NotConfigured,
    SendEvent,
    Workflow,
    durable_workflow,
)
from durable_celery.inputs import check_input, check_key


@pytest.fixture
def durable(tmp_path):
    return Durable(Celery("unit", broker="memory://"), f"sqlite:///{tmp_path}/d.sqlite3", upkeep=False)


def test_steps_become_celery_tasks_with_readable_names(durable):
    sync = durable.workflow("sync_account", reuse="after_close", on_duplicate="run_again")

    @sync.step(retry=3)
    def fetch(account):
        pass

    @sync.step(name="store", queue="slow", timeout=30)
    def save(account):
        pass

    assert [s.name for s in sync.steps] == ["fetch", "store"]
    assert "durable.sync_account.fetch" in durable.app.tasks
    assert "durable.sync_account.store" in durable.app.tasks
    assert sync.steps[0].retry == 3 and sync.steps[1].queue == "slow"
    task = durable.app.tasks["durable.sync_account.fetch"]
    assert task.acks_late and task.serializer == "json"


def test_decorated_function_is_a_one_step_workflow_named_after_it(durable):
    @durable.workflow(key="article:{id}", reuse="after_failure")
    def process_article(id):
        """Process an article."""

    assert isinstance(process_article, Workflow)
    assert process_article.name == "process_article"
    assert [s.name for s in process_article.steps] == ["process_article"]
    assert process_article.derive_key({"id": 42}, None) == "article:42"
    assert process_article.derive_key({"id": 42}, "explicit") == "explicit"

    @durable.workflow
    def bare():
        pass

    assert bare.name == "bare" and "durable.bare.bare" in durable.app.tasks


@pytest.mark.parametrize(
    "options",
    [
        {"reuse": "sometimes"},
        {"on_duplicate": "ignore"},
        {"reuse": "never", "on_duplicate": "run_again"},
        {"idempotency": "maybe"},
        {"timeout": -1},
        {"debounce": {"timeout": 5}},
        {"debounce": {"period": 0}},
        {"key": 42},
    ],
)
def test_bad_workflow_options_are_refused(durable, options):
    with pytest.raises(InvalidDefinition):
        durable.workflow("bad", **options)


def test_bad_steps_are_refused(durable):
    wf = durable.workflow("steps")
    with pytest.raises(InvalidDefinition):
        wf.step(lambda: None, retry=0)
    with pytest.raises(InvalidDefinition):
        wf.step(lambda: None, name="has space")
    with pytest.raises(InvalidDefinition):
        wf.step(lambda: None, timeout=0)
    wf.step(lambda: None, name="one")
    with pytest.raises(InvalidDefinition):
        wf.step(lambda: None, name="one")
    with pytest.raises(InvalidDefinition):
        durable.workflow("steps")
    with pytest.raises(InvalidDefinition):
        Durable(Celery("x", broker="memory://"), "sqlite://", not_a_setting=1)


def test_send_event_and_on_duplicate_values(durable):
    assert durable.workflow("e", on_duplicate=SendEvent("updated")).on_duplicate == SendEvent("updated")
    for bad in ("", "x" * 151, "durable:input:approve", None):
        with pytest.raises(InvalidDefinition):
            SendEvent(bad)
    assert SendEvent("x" * 150).name == "x" * 150


@pytest.mark.parametrize("key", ["k", "x" * 255, "é" * 127, "日本" * 42, "🙂" * 63])
def test_keys_of_1_to_255_utf8_bytes_are_valid(key):
    assert check_key(key) == key


@pytest.mark.parametrize("key", ["", "x" * 256, "é" * 128, "🙂" * 64, 42, b"bytes", ["k"], "\ud800"])
def test_other_keys_are_refused(key):
    with pytest.raises(InvalidKey):
        check_key(key)
    assert issubclass(InvalidKey, InvalidStart) and issubclass(InvalidKey, ValueError)


def test_key_template_missing_field_is_invalid_key(durable):
    wf = durable.workflow("tmpl", key="order:{order_id}")
    with pytest.raises(InvalidKey):
        wf.derive_key({"id": 1}, None)
    required = durable.workflow("req", idempotency="required")
    with pytest.raises(InvalidStart):
        required.derive_key({}, None)
    off = durable.workflow("off", idempotency="off")
    assert off.derive_key({}, "ignored") is None


@pytest.mark.parametrize("bad", [[1, 2], "text", {"when": object()}, {1: "int key"}, {"x": float("nan")}])
def test_input_must_be_a_mapping_of_json(bad):
    with pytest.raises(InvalidStart):
        check_input(bad)


def test_durable_workflow_without_a_durable_raises_not_configured():
    Celery("lonely", broker="memory://", set_as_current=True)

    @durable_workflow(key="x:{n}")
    def orphan(n):
        pass

    with pytest.raises(NotConfigured):
        orphan.start({"n": 1})


def test_durable_workflow_binds_to_the_current_apps_durable(tmp_path):
    @durable_workflow
    def shared_job():
        pass

    app = Celery("shared", broker="memory://", set_as_current=True)
    durable = Durable(app, f"sqlite:///{tmp_path}/s.sqlite3", upkeep=False)
    assert "durable.shared_job.shared_job" in app.tasks
    assert durable.workflows["shared_job"] is shared_job


def test_no_broker_configured_means_the_embedded_serverless_one(tmp_path, monkeypatch):
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    monkeypatch.delenv("DURABLE_DATABASE_URL", raising=False)
    app = Celery("embedded")
    durable = Durable(app, home=str(tmp_path / "home"), upkeep=False)
    assert app.conf.broker_url == "durablefs://"
    assert durable.db.is_sqlite and str(tmp_path / "home") in durable.db.url
