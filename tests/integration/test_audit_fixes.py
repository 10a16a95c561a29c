"""Audit fixes (issue 12): rerun and retry against a debounced holder, run_again refused per call
under reuse="never", a bare number of seconds for cleanup, and losses reset when a run ends."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from durable_celery import InvalidDefinition, KeyTaken, current_run
from durable_celery.store.db import utcnow
from durable_celery.store.schema import activity, keys, runs
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(120)


def row(durable, run_id):
    """A run's stored row, every column."""
    with durable.db.engine.connect() as conn:
        return conn.execute(select(runs).where(runs.c.id == run_id)).one()._asdict()


def entries(durable):
    """Every activity entry, oldest first: (kind, run id, details)."""
    with durable.db.engine.connect() as conn:
        found = conn.execute(
            select(activity.c.kind, activity.c.run_id, activity.c.details).order_by(activity.c.id)
        )
        return [tuple(entry) for entry in found]


def count(durable, table):
    with durable.db.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar()


def lose_once(durable):
    """What a stale take-back leaves on the current run: one more loss during this step."""
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == current_run().id).values(losses=runs.c.losses + 1))


# -- rerun and retry while a debounced holder has the key --------------------------------------


def test_rerun_and_retry_refuse_a_debounced_holder_and_change_nothing(durable):
    wf = durable.workflow("digest", debounce={"period": 0.2})

    @wf.step
    def build(n, fail=False):
        if fail:
            raise RuntimeError("told to fail")

    old = durable.start(wf, {"n": 1, "fail": True}, key="digest:7")
    with worker(durable):
        assert wait_for(durable, old).status == "failed"
    # No worker now: the next start holds the key, debounced, and stays unclaimed.
    holder = durable.start(wf, {"n": 2}, key="digest:7")
    assert holder != old
    before, log_before = row(durable, holder), entries(durable)
    assert (before["status"], before["started_at"], before["published"]) == ("pending", None, False)

    with pytest.raises(KeyTaken) as taken:
        durable.rerun(old)
    assert taken.value.holder_id == holder
    with pytest.raises(KeyTaken) as taken:
        durable.retry(old)
    assert taken.value.holder_id == holder

    assert row(durable, holder) == before  # same input, due time, published flag, status
    assert row(durable, old)["status"] == "failed"
    added = entries(durable)[len(log_before) :]
    assert [(kind, run_id, d["outcome"], d["policy"]) for kind, run_id, d in added] == [
        ("key_duplicate", holder, "error", "error")  # the refused rerun, recorded as refused
    ]
    assert count(durable, runs) == 2
    with durable.db.engine.connect() as conn:
        assert conn.execute(select(keys.c.holder_id).where(keys.c.key == "digest:7")).scalar() == holder


def test_rerun_of_a_debounced_workflow_with_a_free_key_starts_a_debounced_copy(durable):
    wf = durable.workflow("digest", debounce={"period": 60})

    @wf.step
    def build(n):
        pass

    old = durable.start(wf, {"n": 1}, key="digest:8")
    durable.cancel(old)
    new = durable.rerun(old)
    assert new != old
    fresh = row(durable, new)
    assert (fresh["status"], fresh["input"], fresh["published"]) == ("pending", {"n": 1}, False)
    # A start with the key now folds into the new run, as debounce says.
    assert durable.start(wf, {"n": 3}, key="digest:8") == new
    assert row(durable, new)["input"] == {"n": 3}


# -- run_again per call under reuse="never" ------------------------------------------------------


def test_run_again_per_call_is_refused_under_reuse_never_and_writes_nothing(durable):
    wf = durable.workflow("send_invoice", reuse="never", on_duplicate="error")

    @wf.step
    def send(id):
        pass

    with pytest.raises(InvalidDefinition, match="run_again.*reuse='never'"):
        durable.start(wf, {"id": "INV-1"}, key="invoice:INV-1", on_duplicate="run_again")
    assert (count(durable, runs), count(durable, keys), count(durable, activity)) == (0, 0, 0)

    holder = durable.start(wf, {"id": "INV-1"}, key="invoice:INV-1")
    before, log_before = row(durable, holder), entries(durable)
    for call in (
        lambda: durable.start(wf, {"id": "INV-1"}, key="invoice:INV-1", on_duplicate="run_again"),
        lambda: wf.start({"id": "INV-1"}, key="invoice:INV-1", on_duplicate="run_again"),
        lambda: durable.start("send_invoice", {"id": "INV-1"}, key="invoice:INV-1", on_duplicate="run_again"),
    ):
        with pytest.raises(InvalidDefinition, match="send_invoice"):
            call()
    assert (count(durable, runs), count(durable, keys)) == (1, 1)
    assert row(durable, holder) == before
    assert entries(durable) == log_before
    # Other policies still work per call under reuse="never".
    assert durable.start(wf, {"id": "INV-1"}, key="invoice:INV-1", on_duplicate="use_existing") == holder


# -- cleanup: a bare number is seconds -------------------------------------------------------


def _finished_long_ago(durable, run_ids):
    with durable.db.begin() as conn:
        conn.execute(
            update(runs)
            .where(runs.c.id.in_(run_ids))
            .values(finished_at=utcnow() - timedelta(hours=1), created_at=utcnow() - timedelta(hours=2))
        )


def test_cleanup_takes_a_bare_number_as_seconds(durable):
    wf = durable.workflow("job")

    @wf.step
    def only():
        pass

    ids = [durable.start(wf) for _ in range(3)]
    for run_id in ids:
        durable.cancel(run_id)
    _finished_long_ago(durable, ids[:2])
    for older_than in (30, 30.0, "30", " 30 ", "1800", "0.5"):
        assert durable.cleanup(older_than, dry_run=True)["runs"] == 2, older_than
    assert durable.cleanup("7200", dry_run=True)["runs"] == 0  # two hours: none is that old
    assert durable.cleanup("30", ["cancelled"])["runs"] == 2
    with durable.db.engine.connect() as conn:
        assert list(conn.execute(select(runs.c.id)).scalars()) == [ids[2]]


@pytest.mark.parametrize("older_than", ["0", "-30", "30x", "", "1e3"])
def test_cleanup_still_refuses_what_is_not_a_positive_duration(durable, older_than):
    from durable_celery.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="older_than must be"):
        durable.cleanup(older_than, dry_run=True)


def test_cli_cleanup_older_than_a_bare_number_of_seconds(durable, tmp_path):
    wf = durable.workflow("job")

    @wf.step
    def only():
        pass

    ids = [durable.start(wf) for _ in range(3)]
    for run_id in ids:
        durable.cancel(run_id)
    _finished_long_ago(durable, ids[:2])
    (tmp_path / "auditapp.py").write_text(
        textwrap.dedent(f"""
        from celery import Celery
        from durable_celery import Durable
        app = Celery("auditapp", broker="memory://")
        durable = Durable(app, {durable.db.url!r}, upkeep=False)
    """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    def celery(*args, code=0):
        out = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "auditapp", "durable", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == code, out.stdout + out.stderr
        return out.stdout + out.stderr

    before = count(durable, runs), count(durable, activity)
    dry = celery("cleanup", "--older-than", "30", "--dry-run")
    assert "would delete 2 run(s)" in dry and "finished over 30s ago" in dry and "nothing was deleted" in dry
    assert "number of seconds" in celery("cleanup", "--help")
    assert (count(durable, runs), count(durable, activity)) == before
    assert "must be" in celery("cleanup", "--older-than", "30x", code=1)
    done = celery("cleanup", "--older-than", "30", "--status", "cancelled")
    assert "deleted 2 run(s)" in done
    assert count(durable, runs) == 1


# -- losses is reset when a run ends by its step's outcome --------------------------------------


def test_a_run_that_completes_after_a_loss_has_no_losses(durable):
    wf = durable.workflow("lossy")

    @wf.step
    def first():
        lose_once(durable)

    @wf.step
    def last():
        lose_once(durable)  # the last step was once lost, then completed

    one = durable.workflow("lossy_one")

    @one.step
    def only():
        lose_once(durable)

    with worker(durable):
        ids = [durable.start(wf), durable.start(one)]
        for run_id in ids:
            assert wait_for(durable, run_id).status == "completed"
    assert [row(durable, run_id)["losses"] for run_id in ids] == [0, 0]


def test_losses_are_reset_when_a_run_fails_or_ends_its_compensation(durable):
    failing = durable.workflow("fails")

    @failing.step(retry=2)
    def flaky(n):
        lose_once(durable)
        raise RuntimeError("told to fail")

    undone = durable.workflow("undone")

    def refund(n):
        lose_once(durable)

    @undone.step(compensate=refund)
    def charge(n):
        pass

    @undone.step
    def ship(n):
        raise RuntimeError("warehouse on fire")

    stuck = durable.workflow("stuck")

    def cannot_undo(n):
        lose_once(durable)
        raise RuntimeError("cannot undo")

    @stuck.step(compensate=cannot_undo, compensate_retry=1)
    def reserve(n):
        pass

    @stuck.step
    def deliver(n):
        raise RuntimeError("no truck")

    with worker(durable):
        ids = [durable.start(wf, {"n": 1}) for wf in (failing, undone, stuck)]
        statuses = [wait_for(durable, run_id).status for run_id in ids]
    assert statuses == ["failed", "compensated", "compensation_failed"]
    assert [row(durable, run_id)["losses"] for run_id in ids] == [0, 0, 0]
