"""A debounced holder and its key: a start against a holder a worker has started is an ordinary
duplicate, not folded in; rerun and retry while an unclaimed debounced holder has the key are
refused and change nothing; a rerun with the key free starts a debounced copy. On both
backends."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from durable_celery import KeyTaken
from durable_celery.store.schema import keys, runs
from durable_celery.testing import wait_for, worker
from tests.integration.helpers import activity_log, count_rows, run_dict

pytestmark = pytest.mark.timeout(120)


def test_a_start_against_a_started_debounced_holder_is_an_ordinary_duplicate(durable):
    """Guards issue 16, a hand-made break listed as equivalent (tests/mutation/equivalent.md): that
    ``KeyDecision._duplicate`` computes ``unclaimed`` with ``holder.started_at is None`` is
    redundant, so dropping it is an equivalent change, for two reasons. (1) Every use of
    ``unclaimed`` is ``unclaimed and self._take_input(...)``, whose ``UPDATE`` matches only
    ``status = 'pending' AND started_at IS NULL``: for a started holder it changes nothing and
    returns False, and the start goes on exactly as if ``unclaimed`` were False. (2) No run is
    ``pending`` once started anyway: a claim makes it ``running``, and ``retry`` puts a started run
    back as ``running`` (``pending`` only if it never started). This test still pins the behaviour:
    a start against a started, retried debounced holder is a plain duplicate."""
    wf = durable.workflow("debounced_started", debounce={"period": 60})

    @wf.step
    def only(n):
        return n

    holder = durable.start(wf, {"n": 1}, key="k")
    # As after a claim and a retry: started, then put back to be run again.
    with durable.db.begin() as conn:
        started = conn.execute(select(runs.c.created_at).where(runs.c.id == holder)).scalar_one()
        conn.execute(update(runs).where(runs.c.id == holder).values(started_at=started))
    before = durable.get_run(holder)
    assert durable.start(wf, {"n": 2}, key="k") == holder
    after = durable.get_run(holder)
    assert after.input == {"n": 1}  # not folded in: the started holder keeps its input
    entry = durable.activity(kinds=["key_duplicate"])[0]
    assert entry.details["outcome"] == "use_existing"
    assert (after.status, after.started_at) == (before.status, before.started_at)


def test_rerun_and_retry_refuse_a_debounced_holder_and_change_nothing(durable):
    """Guards issue 12: rerun and retry while a debounced holder (unclaimed, waiting out its
    period) has the key are refused with ``KeyTaken`` naming it; the holder's input, due
    time and published flag are left as they were, and only the refusal is recorded."""
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
    before, log_before = run_dict(durable, holder), activity_log(durable)
    assert (before["status"], before["started_at"], before["published"]) == ("pending", None, False)

    with pytest.raises(KeyTaken) as taken:
        durable.rerun(old)
    assert taken.value.holder_id == holder
    with pytest.raises(KeyTaken) as taken:
        durable.retry(old)
    assert taken.value.holder_id == holder

    assert run_dict(durable, holder) == before  # same input, due time, published flag, status
    assert run_dict(durable, old)["status"] == "failed"
    added = activity_log(durable)[len(log_before) :]
    assert [(kind, run_id, d["outcome"], d["policy"]) for kind, run_id, d in added] == [
        ("key_duplicate", holder, "error", "error")  # the refused rerun, recorded as refused
    ]
    assert count_rows(durable, runs) == 2
    with durable.db.engine.connect() as conn:
        assert conn.execute(select(keys.c.holder_id).where(keys.c.key == "digest:7")).scalar() == holder


def test_rerun_of_a_debounced_workflow_with_a_free_key_starts_a_debounced_copy(durable):
    """Guards issue 12: with the key free, a rerun of a debounced workflow starts a copy that
    is debounced too (unpublished, pending), into which a later start folds."""
    wf = durable.workflow("digest", debounce={"period": 60})

    @wf.step
    def build(n):
        pass

    old = durable.start(wf, {"n": 1}, key="digest:8")
    durable.cancel(old)
    new = durable.rerun(old)
    assert new != old
    fresh = run_dict(durable, new)
    assert (fresh["status"], fresh["input"], fresh["published"]) == ("pending", {"n": 1}, False)
    # A start with the key now folds into the new run, as debounce says.
    assert durable.start(wf, {"n": 3}, key="digest:8") == new
    assert run_dict(durable, new)["input"] == {"n": 3}
