"""A fire of a workflow that neither this app nor any worker node of its database has is
refused (the wrong app took it) and writes nothing; tests/e2e/test_schedule_wrong_app.py does
it with two real worker apps sharing a broker."""

from __future__ import annotations

import logging

import pytest

from durable_celery import UnknownWorkflow
from durable_celery import schedules as schedules_module
from durable_celery.store import node_rows

pytestmark = pytest.mark.timeout(60)


def test_a_fire_of_a_workflow_nothing_here_has_is_refused_and_writes_nothing(make_durable, caplog):
    other = make_durable("other_app")
    other.workflow("nightly").step(lambda: None, name="build")
    kwargs = other.beat_entry("nightly", 60, key="n")["kwargs"]
    wrong = make_durable("wrong_app")
    wrong.workflow("invoice").step(lambda: None, name="send")
    with caplog.at_level(logging.ERROR, logger="durable_celery"), pytest.raises(UnknownWorkflow) as refused:
        schedules_module.fire(wrong.runtime, wrong.app, **kwargs)
    assert "workflow 'nightly' is not defined in app 'wrong_app'" in str(refused.value)
    assert any("refused a fire of schedule 'nightly:n'" in r.getMessage() for r in caplog.records)
    assert wrong.list_runs() == [] and wrong.list_schedules() == []
    assert wrong.activity() == []
    # Once a node with the code has been seen by this database, the fire starts the run by name.
    with wrong.db.begin() as conn:
        node_rows.register_node_txn(wrong.db, conn, "coded@test", ["q"], 1, {"nightly": ["build"]})
    started = schedules_module.fire(wrong.runtime, wrong.app, **kwargs)
    assert started["outcome"] == "started"
    assert wrong.get_run(started["run_id"]).workflow == "nightly"
