"""Retry, rerun and release of keys, starts inside callers' transactions, and watching keys."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from sqlalchemy import create_engine, delete, text
from sqlalchemy.orm import Session

from durable_celery import KeyContended, KeyTaken, NoKey, NotFinished, RunNotFound, signals
from durable_celery.store import key_rows
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for, worker
from tests.integration.core.test_keys_rules import define, holders, make_holder

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["postgres", "sqlite", "fake"])
def backend(request: pytest.FixtureRequest) -> str:
    """These rules also hold on testing.Fake (the memory store), so it cannot drift from them."""
    return str(request.param)


def test_release_key_lets_a_never_key_run_again(durable):
    wf = define(durable, reuse="never")
    released = []
    signals.key_release.connect(lambda sender, **kw: released.append(kw), weak=False)
    try:
        first = make_holder(durable, wf, "completed", key="invoice:INV-2208")
        with pytest.raises(KeyTaken):
            durable.rerun(first)
        durable.release_key(first, by="ops@example.com")
    finally:
        signals.key_release.receivers.clear()
    run = durable.get_run(first)
    assert run.key == "invoice:INV-2208" and not run.holds_key and run.status == "completed"
    second = durable.rerun(first)
    assert second != first and durable.get_run(second).input == run.input
    assert holders(durable, "invoice:INV-2208") == [second]
    (entry,) = durable.activity(kinds=["key_released"])
    assert entry.run_id == first and entry.details["by"] == "ops@example.com"
    assert entry.details["key"] == "invoice:INV-2208" and entry.details["workflow"] == "job"
    assert released[0]["run_id"] == first and released[0]["by"] == "ops@example.com"


def test_release_key_refuses_unfinished_and_keyless_runs(durable):
    wf = define(durable)
    going = durable.start(wf, key="k")
    with pytest.raises(NotFinished):
        durable.release_key(going)
    unkeyed = make_holder(durable, wf, "completed", key=None)
    with pytest.raises(NoKey):
        durable.release_key(unkeyed)
    with pytest.raises(RunNotFound):
        durable.release_key("no-such-run")
    durable.cancel(going)
    durable.release_key(going)
    with pytest.raises(NoKey):  # released already
        durable.release_key(going)


def test_rerun_refuses_an_unfinished_run(durable):
    wf = define(durable)
    going = durable.start(wf, key="k")
    with pytest.raises(NotFinished):
        durable.rerun(going)


def test_retry_resumes_from_the_failed_step_and_retakes_its_key(durable):
    flaky = {"fail": True}
    calls = []
    wf = durable.workflow("pipeline")

    @wf.step
    def extract(n):
        calls.append("extract")
        return n

    @wf.step
    def load(n):
        calls.append("load")
        if flaky["fail"]:
            raise RuntimeError("warehouse down")
        return n * 10

    with worker(durable):
        failed = durable.start(wf, {"n": 1}, key="batch:1")
        assert wait_for(durable, failed).status == "failed"
    # a newer run takes the key (failed frees it under after_close) and is still going
    newer = durable.start(wf, {"n": 2}, key="batch:1")
    assert newer != failed and durable.get_run(newer).status == "pending"
    with pytest.raises(KeyTaken) as info:
        durable.retry(failed)
    assert info.value.holder_id == newer
    assert durable.get_run(failed).status == "failed"  # nothing changed
    durable.cancel(newer)
    flaky["fail"] = False
    calls.clear()
    with worker(durable):
        assert durable.retry(failed) == failed
        run = wait_for(durable, failed)
    assert run.status == "completed" and run.output == 10
    assert calls == ["load"]  # resumed from the failed step
    assert holders(durable, "batch:1") == [failed]
    (retaken,) = durable.activity(kinds=["key_retaken"])
    assert retaken.run_id == failed and retaken.details["from"] == newer


def test_retry_of_a_run_still_holding_its_key_changes_no_key(durable):
    wf = define(durable)
    failed = make_holder(durable, wf, "failed")
    with worker(durable):
        durable.retry(failed)
        assert wait_for(durable, failed).status == "failed"
    assert holders(durable) == [failed]
    assert durable.activity(kinds=["key_retaken"]) == []
    with pytest.raises(Exception) as info:
        durable.retry(make_holder(durable, wf, "completed", key="other"))
    assert "only failed runs" in str(info.value)


def test_deleting_the_holder_frees_its_key(durable):
    wf = define(durable, reuse="never")
    holder = make_holder(durable, wf, "completed")
    with durable.db.begin() as conn:
        conn.execute(delete(runs).where(runs.c.id == holder))
    assert durable.list_keys() == []
    assert durable.start(wf, key="k") != holder


def test_key_contended_after_three_hand_changes(durable, monkeypatch):
    wf = define(durable)
    durable.start(wf, key="k")
    # Every time the start locks the key row it finds it gone, as when other starts and
    # releases keep handing it around.
    monkeypatch.setattr(key_rows, "lock_key_txn", lambda db, conn, workflow, key: None)
    with pytest.raises(KeyContended):
        durable.start(wf, {"n": 2}, key="k", on_duplicate="error")
    assert len(durable.list_runs()) == 1


# -- inside the caller's transaction -----------------------------------------------------------


@pytest.fixture
def user_engine(durable):
    engine = create_engine(durable.db.url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE articles (id integer primary key, title text)"))
    yield engine
    engine.dispose()


def test_rollback_removes_the_run_and_its_key_claim(durable, user_engine):
    wf = define(durable)
    with user_engine.connect() as conn:
        trans = conn.begin()
        conn.execute(text("INSERT INTO articles VALUES (1, 'a')"))
        run_id = durable.start(wf, {"n": 1}, key="article:1", connection=conn)
        trans.rollback()
    with pytest.raises(RunNotFound):
        durable.get_run(run_id)
    assert durable.list_keys() == []
    assert durable.start(wf, key="article:1") != run_id


def test_duplicate_inside_a_transaction_leaves_it_usable(durable, user_engine):
    wf = define(durable, on_duplicate="error")
    holder = durable.start(wf, {"n": 1}, key="article:1")
    with Session(user_engine) as session:
        session.execute(text("INSERT INTO articles VALUES (1, 'first')"))
        same = durable.start(wf, {"n": 2}, key="article:1", connection=session, on_duplicate="use_existing")
        assert same == holder
        with pytest.raises(KeyTaken):
            durable.start(wf, {"n": 3}, key="article:1", connection=session)
        session.execute(text("INSERT INTO articles VALUES (2, 'second')"))  # still usable
        session.commit()
    with user_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM articles")).scalar() == 2
    assert len(durable.list_runs()) == 1


def test_nothing_runs_before_commit(durable, user_engine):
    ran = []
    wf = durable.workflow("after_commit")

    @wf.step
    def go(n):
        ran.append(n)
        return n

    with worker(durable):
        with user_engine.connect() as conn, conn.begin():
            run_id = durable.start(wf, {"n": 1}, key="k", connection=conn)
            with pytest.raises(RunNotFound):  # no other connection, so no worker, can see it
                durable.get_run(run_id)
            assert ran == []
        assert wait_for(durable, run_id).output == 1
    assert ran == [1]


# -- watching ---------------------------------------------------------------------------------


def test_list_keys_and_key_stats(durable):
    wf = define(durable, "process_article", reuse="after_failure")
    b = make_holder(durable, wf, "failed", key="article:2")
    c = durable.start(wf, {"n": 4}, key="article:2")  # failed frees it: a hand-off
    a = durable.start(wf, {"n": 1}, key="article:1")
    durable.start(wf, {"n": 1}, key="article:1")
    durable.start(wf, {"n": 2}, key="article:1")
    durable.start(wf, {"n": 3}, key="article:1")
    other = define(durable, "elsewhere")
    durable.start(other, key="article:1")

    entries = {e.key: e for e in durable.list_keys(workflow="process_article")}
    assert set(entries) == {"article:1", "article:2"}
    assert entries["article:1"].holder_id == a and entries["article:1"].holder_status == "pending"
    assert entries["article:1"].runs == 1 and entries["article:1"].readds_last_day == 3
    assert entries["article:2"].holder_id == c and entries["article:2"].runs == 2
    assert entries["article:2"].readds_last_day == 0

    stats = durable.stats.keys(workflow="process_article")
    assert stats["keys_held"] == 2
    assert stats["readds"] == 3 and stats["readds_by_outcome"] == {"use_existing": 3}
    assert stats["dropped_inputs"] == 2  # two of the three brought a different input
    assert stats["handoffs"] == 1
    assert sum(h["count"] for h in stats["readds_over_time"]) == 3
    assert stats["top_keys"] == [{"workflow": "process_article", "key": "article:1", "readds": 3}]
    assert durable.stats.keys()["keys_held"] == 3
    by_key = durable.list_runs(key="article:2")
    assert [(r.id, r.holds_key) for r in by_key] == [(c, True), (b, False)]


def test_key_signals(durable):
    wf = define(durable)
    seen = []
    signals.key_duplicate.connect(lambda sender, **kw: seen.append(("dup", kw["outcome"])), weak=False)
    signals.key_handoff.connect(lambda sender, **kw: seen.append(("handoff", kw["previous_id"])), weak=False)
    try:
        first = make_holder(durable, wf, "cancelled")
        second = durable.start(wf, key="k")
        durable.start(wf, key="k")
    finally:
        signals.key_duplicate.receivers.clear()
        signals.key_handoff.receivers.clear()
    assert seen == [("handoff", first), ("dup", "use_existing")]
    assert holders(durable) == [second]


def test_cli_keys_report_and_runs_by_key(durable, tmp_path):
    wf = define(durable, "sync_account")
    holder = durable.start(wf, {"n": 1}, key="sync:account:7")
    durable.start(wf, {"n": 2}, key="sync:account:7")
    module = tmp_path / "keyapp.py"
    module.write_text(
        textwrap.dedent(f"""
        from celery import Celery
        from durable_celery import Durable
        app = Celery("keyapp", broker="memory://")
        durable = Durable(app, {durable.db.url!r}, upkeep=False)
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def celery(*args):
        out = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "keyapp", "durable", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    report = celery("keys", "--workflow", "sync_account")
    assert "keys held: 1" in report and "re-adds (7 days): 1" in report
    assert "sync:account:7" in report and holder in report
    listing = celery("runs", "--key", "sync:account:7")
    assert holder in listing and "yes" in listing


def test_session_rolled_back_then_committed_publishes_nothing(durable, user_engine):
    wf = define(durable)
    started = []
    signals.run_started.connect(lambda sender, run_id, **kw: started.append(run_id), weak=False)
    try:
        with Session(user_engine) as session:
            run_id = durable.start(wf, {"n": 1}, key="k", connection=session)
            session.rollback()
            session.execute(text("INSERT INTO articles VALUES (1, 'later')"))
            session.commit()
    finally:
        signals.run_started.receivers.clear()
    assert started == []
    with pytest.raises(RunNotFound):
        durable.get_run(run_id)


def test_a_retried_run_gives_later_steps_their_own_attempts(durable):
    fail = {"first": True}
    wf = durable.workflow("two_steps")

    @wf.step
    def first():
        if fail["first"]:
            raise RuntimeError("first fails once")

    @wf.step(retry=1)
    def second():
        raise RuntimeError("second fails")

    run_id = durable.start(wf)
    with worker(durable):
        assert wait_for(durable, run_id).status == "failed"
        fail["first"] = False
        durable.retry(run_id)
        run = wait_for(durable, run_id)
    assert run.status == "failed" and run.error["message"] == "second fails"
    steps = [(s.name, s.attempt, s.status) for s in durable.list_steps(run_id)]
    assert steps == [("first", 1, "failed"), ("first", 2, "completed"), ("second", 1, "failed")]
