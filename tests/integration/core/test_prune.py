"""Retention: prune rules, key freeing, unfinished runs kept, batches, cleanup and its CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from durable_celery import InvalidDefinition, KeyTaken, current_run
from durable_celery.core import prune as prune_module
from durable_celery.errors import InvalidArgument
from durable_celery.store.db import utcnow
from durable_celery.store.schema import activity, events, keys, runs, steps
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(120)

WEEK = timedelta(days=7)
MONTH = timedelta(days=30)


def define(durable, name="job", **options):
    """A two-step workflow that fails when told to."""
    wf = durable.workflow(name, **options)

    @wf.step
    def first(n=0, fail=False):
        current_run().context["n"] = n

    @wf.step
    def second(n=0, fail=False):
        if fail:
            raise RuntimeError("told to fail")
        return n

    return wf


def finish(durable, wf, inputs, key=None):
    """Start one run per input and work them all to their end; returns their ids."""
    ids = [durable.start(wf, data, key=key) for data in inputs]
    with worker(durable):
        for run_id in ids:
            wait_for(durable, run_id)
    return ids


def backdate(durable, run_ids, days, status=None):
    """Make runs look finished ``days`` ago (optionally in another finished status)."""
    values = {
        "finished_at": func.now() - timedelta(days=days) if durable.db.is_postgres else None,
        "created_at": func.now() - timedelta(days=days + 1) if durable.db.is_postgres else None,
    }
    if not durable.db.is_postgres:
        from durable_celery.store.db import utcnow

        values = {
            "finished_at": utcnow() - timedelta(days=days),
            "created_at": utcnow() - timedelta(days=days + 1),
        }
    if status is not None:
        values["status"] = status
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id.in_(list(run_ids))).values(**values))


def count(durable, table, *where):
    with durable.db.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table).where(*where)).scalar()


def existing(durable, run_ids):
    with durable.db.engine.connect() as conn:
        return set(conn.execute(select(runs.c.id).where(runs.c.id.in_(list(run_ids)))).scalars())


def test_rules_delete_old_finished_runs_with_their_steps_and_events(make_durable):
    durable = make_durable(prune={"completed": WEEK, "failed": MONTH})
    wf = define(durable)
    done = finish(durable, wf, [{"n": i} for i in range(4)])
    failed = finish(durable, wf, [{"fail": True} for _ in range(4)])
    cancelled = [durable.start(wf) for _ in range(2)]
    for run_id in cancelled:
        durable.cancel(run_id)
    waiter = durable.workflow("waiter")

    @waiter.step
    def wait_go():
        return current_run().wait_for_event("go", timeout=60)

    waited = durable.start(waiter)
    with worker(durable):
        wait_for(durable, waited, statuses=("waiting",))
        durable.send_event(waited, "go", {"x": 1})
        assert wait_for(durable, waited).status == "completed"
    done.append(waited)
    done[0], done[-1] = done[-1], done[0]
    backdate(durable, done[:2], 8)  # old enough
    backdate(durable, done[2:3], 6)  # too young
    backdate(durable, failed[:1], 31)  # old enough
    backdate(durable, failed[1:2], 31, status="compensated")  # "failed" covers it
    backdate(durable, failed[2:3], 31, status="compensation_failed")  # and this
    backdate(durable, failed[3:], 29)  # too young
    backdate(durable, cancelled, 400)  # no rule for cancelled: kept forever
    assert count(durable, events, events.c.run_id == done[0]) == 1
    assert count(durable, steps, steps.c.run_id.in_(done[:2] + failed[:3])) >= 9

    counts = durable.prune()

    assert counts == {"completed": 2, "failed": 3}
    gone = set(done[:2] + failed[:3])
    assert existing(durable, gone) == set()
    assert existing(durable, done[2:] + failed[3:] + cancelled) == set(done[2:] + failed[3:] + cancelled)
    assert count(durable, steps, steps.c.run_id.in_(list(gone))) == 0
    assert count(durable, events, events.c.run_id == done[0]) == 0
    assert count(durable, steps, steps.c.run_id == done[3]) == 2
    assert count(durable, events) == 0
    assert durable.prune() == {"completed": 0, "failed": 0}


def test_unfinished_runs_are_never_pruned(make_durable):
    durable = make_durable(prune={"completed": WEEK, "cancelled": WEEK, "failed": WEEK})
    wf = define(durable)
    sleeper = durable.workflow("sleeper")

    @sleeper.step
    def nap():
        current_run().sleep(3600)

    pending = durable.start(wf)
    waiting = durable.start(sleeper)
    with worker(durable):
        wait_for(durable, waiting, statuses=("waiting",))
    # However old they look, an unfinished status keeps them.
    backdate(durable, [pending, waiting], 1000)
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == pending).values(status="pending"))
        conn.execute(update(runs).where(runs.c.id == waiting).values(status="waiting"))
    assert durable.prune() == {"completed": 0, "cancelled": 0, "failed": 0}
    assert durable.cleanup("1s") == {"runs": 0, "steps": 0, "events": 0}
    assert existing(durable, [pending, waiting]) == {pending, waiting}
    with pytest.raises(InvalidArgument, match="unfinished"):
        durable.cleanup("1s", ["running"])


@pytest.mark.parametrize("reuse", ["never", "after_failure"])
def test_a_pruned_holders_key_is_free_again(make_durable, reuse):
    durable = make_durable(prune={"completed": WEEK})
    wf = define(durable, reuse=reuse, on_duplicate="error")
    (holder,) = finish(durable, wf, [{"n": 1}], key="invoice:7")
    with pytest.raises(KeyTaken) as taken:
        durable.start(wf, {"n": 2}, key="invoice:7")
    assert taken.value.holder_id == holder
    backdate(durable, [holder], 8)
    assert durable.prune() == {"completed": 1}
    assert count(durable, keys, keys.c.holder_id == holder) == 0
    second = durable.start(wf, {"n": 2}, key="invoice:7")
    assert second != holder and durable.get_run(second).holds_key
    with worker(durable):
        assert wait_for(durable, second).output == 2


def test_prune_works_in_batches_and_records_one_activity_entry_each(make_durable, monkeypatch):
    monkeypatch.setattr(prune_module, "BATCH", 3)
    durable = make_durable(prune={"cancelled": timedelta(hours=1)})
    wf = define(durable)
    ids = [durable.start(wf) for _ in range(7)]
    for run_id in ids:
        durable.cancel(run_id)
    backdate(durable, ids, 1)
    lines = []
    assert durable.prune(progress=lines.append) == {"cancelled": 7}
    entries = durable.activity(kinds=["runs_pruned"])
    assert sorted(e.details["runs"] for e in entries) == [1, 3, 3]
    assert all(e.details["rule"] == "cancelled" for e in entries)
    assert lines[-1] == "cancelled: deleted 7 run(s) so far"


def test_cleanup_by_age_and_status_and_its_dry_run(make_durable):
    durable = make_durable()
    wf = define(durable)
    done = finish(durable, wf, [{"n": 1}, {"n": 2}])
    cancelled = durable.start(wf)
    durable.cancel(cancelled)
    backdate(durable, done + [cancelled], 40)
    before = count(durable, runs), count(durable, steps), count(durable, activity)
    assert durable.cleanup("30d", dry_run=True) == {"runs": 3, "steps": 4, "events": 0}
    assert durable.cleanup("41d", dry_run=True) == {"runs": 0, "steps": 0, "events": 0}
    assert (count(durable, runs), count(durable, steps), count(durable, activity)) == before
    lines = []
    assert durable.cleanup("30d", "cancelled", progress=lines.append)["runs"] == 1
    assert existing(durable, done + [cancelled]) == set(done)
    assert lines[0].startswith("deleting 1 run(s) with 0 step row(s) and 0 event(s)")
    assert durable.cleanup(timedelta(days=30))["runs"] == 2


@pytest.mark.parametrize(
    "rules",
    [
        {"finished": WEEK},
        {"completed": -5},
        {"completed": "7 days"},
        {"completed": timedelta(0)},
        {"failed": True},
        ["completed"],
    ],
)
def test_bad_prune_rules_are_refused(make_durable, rules):
    with pytest.raises(InvalidDefinition):
        make_durable(prune=rules)


@pytest.mark.parametrize(
    ("older_than", "statuses"),
    [("1e3", None), ("-3d", None), ("", None), ("3x", None), (0, None), ("30d", ["bogus"]), ("30d", [""])],
)
def test_bad_cleanup_arguments_write_nothing(durable, older_than, statuses):
    wf = define(durable)
    run_id = durable.start(wf)
    durable.cancel(run_id)
    backdate(durable, [run_id], 100)
    with pytest.raises(InvalidArgument):
        durable.cleanup(older_than, statuses)
    assert existing(durable, [run_id]) == {run_id}


def test_durations():
    parse = prune_module.parse_duration
    assert parse("30d") == timedelta(days=30)
    assert parse("1d12h") == timedelta(days=1, hours=12)
    assert parse("2w") == timedelta(weeks=2)
    assert parse("90m") == parse(5400) == parse(timedelta(minutes=90))
    assert parse("1.5h") == timedelta(minutes=90)
    show = prune_module.format_duration
    assert [show(parse(t)) for t in ("30d", "1d12h", "90m", "45s", "2w", "0.5s")] == [
        "30d",
        "1d12h",
        "1h30m",
        "45s",
        "14d",
        "0.5s",
    ]


@pytest.mark.parametrize("backend", ["postgres"])
def test_prune_skips_rows_another_transaction_holds(make_durable):
    durable = make_durable(prune={"cancelled": WEEK})
    wf = define(durable)
    ids = [durable.start(wf) for _ in range(4)]
    for run_id in ids:
        durable.cancel(run_id)
    backdate(durable, ids, 8)
    with durable.db.engine.connect() as other:
        with other.begin():
            other.execute(select(runs.c.id).where(runs.c.id == ids[0]).with_for_update())
            assert durable.prune() == {"cancelled": 3}  # did not wait for the locked row
        assert existing(durable, ids) == {ids[0]}
    assert durable.prune() == {"cancelled": 1}


@pytest.mark.parametrize("backend", ["postgres"])
def test_workers_prune_on_their_own(make_durable):
    durable = make_durable(prune={"cancelled": WEEK}, prune_interval=0.5)
    wf = define(durable)
    ids = [durable.start(wf) for _ in range(3)]
    for run_id in ids:
        durable.cancel(run_id)
    backdate(durable, ids, 8)
    with worker(durable):
        import time

        deadline = time.monotonic() + 20
        while existing(durable, ids) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert existing(durable, ids) == set()


def test_cli_cleanup_dry_run_writes_nothing_then_deletes(durable, tmp_path):
    wf = define(durable)
    ids = [durable.start(wf) for _ in range(3)]
    for run_id in ids:
        durable.cancel(run_id)
    backdate(durable, ids[:2], 45)
    module = tmp_path / "pruneapp.py"
    module.write_text(
        textwrap.dedent(f"""
        from datetime import timedelta
        from celery import Celery
        from durable_celery import Durable
        app = Celery("pruneapp", broker="memory://")
        durable = Durable(app, {durable.db.url!r}, upkeep=False, prune={{"cancelled": timedelta(days=40)}})
    """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    def celery(*args, code=0):
        out = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "pruneapp", "durable", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == code, out.stderr
        return out.stdout + out.stderr

    before = count(durable, runs), count(durable, activity)
    assert "--older-than" in celery("cleanup", "--help")
    dry = celery("cleanup", "--older-than", "30d", "--status", "cancelled", "--dry-run")
    assert "would delete 2 run(s)" in dry and "nothing was deleted" in dry
    assert (count(durable, runs), count(durable, activity)) == before
    assert "unfinished" in celery("cleanup", "--older-than", "30d", "--status", "running", code=1)
    assert "must be" in celery("cleanup", "--older-than", "soon", code=1)
    assert (count(durable, runs), count(durable, activity)) == before
    done = celery("cleanup", "--older-than", "30d", "--status", "cancelled")
    assert "deleting 2 run(s)" in done and "deleted 2 run(s)" in done
    assert existing(durable, ids) == {ids[2]}
    backdate(durable, ids[2:], 41)
    pruned = celery("prune")
    assert "pruned: 1 cancelled" in pruned
    assert existing(durable, ids) == set()


@pytest.mark.parametrize("backend", ["postgres"])
def test_prune_never_waits_for_a_key_row_a_start_holds(make_durable):
    # A start locks the key row before the holder's row; the pruner must not wait for the key
    # row while holding the run's row (that would deadlock), so it leaves that run for later.
    durable = make_durable(prune={"completed": WEEK})
    wf = define(durable, reuse="never")
    (holder,) = finish(durable, wf, [{"n": 1}], key="k1")
    others = finish(durable, wf, [{"n": 2}, {"n": 3}])
    backdate(durable, [holder, *others], 8)
    with durable.db.engine.connect() as start:
        with start.begin():
            start.execute(select(keys.c.holder_id).where(keys.c.key == "k1").with_for_update())
            assert durable.prune() == {"completed": 2}
        assert existing(durable, [holder, *others]) == {holder}
    assert durable.prune() == {"completed": 1}
    assert count(durable, keys) == 0


@pytest.mark.parametrize("interval", [0, -1, "hourly", True])
def test_bad_prune_interval_is_refused(make_durable, interval):
    with pytest.raises(InvalidDefinition):
        make_durable(prune={"completed": WEEK}, prune_interval=interval)


def test_prune_is_off_by_default_and_rules_come_from_app_conf(make_durable):
    durable = make_durable()
    assert durable.settings.prune is None and durable.prune() == {}
    from celery import Celery

    app = Celery("conf_rules", broker="memory://")
    app.conf.durable_prune = {"failed": "30d"}
    from durable_celery import Durable

    configured = Durable(app, durable.db.url, upkeep=False)
    try:
        assert configured.settings.prune == {"failed": timedelta(days=30)}
    finally:
        configured.db.dispose()


def test_a_finished_child_of_a_parent_still_going_is_kept(make_durable):
    durable = make_durable(prune={"completed": WEEK})
    child = durable.workflow("pruned_child")
    child.step(lambda: "done", name="only")
    parent = durable.workflow("long_parent")

    @parent.step
    def call_then_nap():
        current_run().call_workflow(child)  # found again on every replay of this step
        current_run().sleep(3600)

    parent_id = durable.start(parent)
    with worker(durable):
        wait_for(durable, parent_id, statuses=("waiting",))
        _until(lambda: [k.status for k in durable.list_children(parent_id)] == ["completed"])
        wait_for(durable, parent_id, statuses=("waiting",))
    (kid,) = durable.list_children(parent_id)
    backdate(durable, [kid.id], 1000)
    assert durable.prune()["completed"] == 0
    assert durable.cleanup("1s", ["completed"])["runs"] == 0
    assert existing(durable, [kid.id]) == {kid.id}
    with durable.db.begin() as conn:  # once the parent has finished, the child goes as usual
        conn.execute(update(runs).where(runs.c.id == parent_id).values(status="cancelled"))
    backdate(durable, [parent_id], 1000, status="cancelled")
    assert durable.prune()["completed"] == 1
    assert existing(durable, [kid.id]) == set()


def _until(condition, seconds: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_upkeep_prunes_a_batch_per_rule_per_pass_until_none_is_left(make_durable, monkeypatch):
    monkeypatch.setattr(prune_module, "BATCH", 3)
    durable = make_durable(prune={"cancelled": timedelta(hours=1), "completed": timedelta(hours=1)})
    wf = define(durable)
    ids = [durable.start(wf) for _ in range(7)]
    for run_id in ids:
        durable.cancel(run_id)
    backdate(durable, ids, 1)
    left = []
    while prune_module.prune_some(durable.db, durable.settings.prune):  # what each upkeep pass runs
        left.append(len(existing(durable, ids)))
    assert left == [4, 1] and existing(durable, ids) == set()
    assert (
        prune_module.prune_some(durable.db, durable.settings.prune) is False
    )  # nothing left: back to prune_interval


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_deleting_runs_by_hand_takes_their_steps_events_and_keys_along(make_durable):
    # PostgreSQL: one trigger per DELETE statement (no foreign keys to durable_runs);
    # SQLite: foreign keys. Either way nothing is left pointing at a deleted run.
    durable = make_durable()
    wf = define(durable, "by_hand", reuse="never")
    holder, other = finish(durable, wf, [{"n": 1}], key="k1")[0], finish(durable, wf, [{"n": 2}])[0]
    with durable.db.begin() as conn:
        conn.execute(keys.insert().values(workflow="by_hand", key="k2", holder_id=other, taken_at=func.now()))
        conn.execute(update(keys).where(keys.c.key == "k1").values(waiting_id=other))
        conn.execute(events.insert().values(run_id=holder, name="e", payload=None, created_at=func.now()))
    with durable.db.begin() as conn:
        conn.execute(runs.delete().where(runs.c.id == other))
    with durable.db.engine.connect() as conn:
        left = select(func.count()).select_from(steps).where(steps.c.run_id == other)
        assert conn.execute(left).scalar() == 0
        assert conn.execute(select(keys.c.key, keys.c.waiting_id)).all() == [("k1", None)]
    with durable.db.begin() as conn:
        conn.execute(runs.delete().where(runs.c.id.in_([holder])))
    with durable.db.engine.connect() as conn:
        for table in (steps, events, keys):
            assert conn.execute(select(func.count()).select_from(table)).scalar() == 0, table.name


@pytest.mark.parametrize("backend", ["postgres"])
def test_truncating_runs_truncates_what_goes_with_them_and_an_orphan_key_row_holds_nothing(make_durable):
    from sqlalchemy import text

    durable = make_durable()
    wf = define(durable, "truncated", reuse="never")
    finish(durable, wf, [{"n": 1}], key="k")
    with durable.db.begin() as conn:
        conn.execute(text("TRUNCATE durable_runs"))
    with durable.db.engine.connect() as conn:
        for table in (steps, events, keys):
            assert conn.execute(select(func.count()).select_from(table)).scalar() == 0, table.name
    # A key row whose holder is gone (written with the trigger bypassed): the next start takes it.
    with durable.db.begin() as conn:
        conn.execute(text("SET LOCAL session_replication_role = replica"))
        orphan = {"workflow": "truncated", "key": "k", "holder_id": "gone", "taken_at": func.now()}
        conn.execute(keys.insert().values(**orphan))
    run_id = durable.start(wf, {"n": 2}, key="k")
    with durable.db.engine.connect() as conn:
        assert conn.execute(select(keys.c.holder_id).where(keys.c.key == "k")).scalar() == run_id


# -- older_than as a bare number of seconds -----------------------------------------------------


def _finished_long_ago(durable, run_ids):
    with durable.db.begin() as conn:
        conn.execute(
            update(runs)
            .where(runs.c.id.in_(run_ids))
            .values(finished_at=utcnow() - timedelta(hours=1), created_at=utcnow() - timedelta(hours=2))
        )


def test_cleanup_takes_a_bare_number_as_seconds(durable):
    """Guards issue 12: ``cleanup(older_than=...)`` takes a bare number (an int, a float or a
    numeric string) as seconds."""
    wf = durable.workflow("job")

    @wf.step
    def only():
        pass

    ids = [durable.start(wf) for _ in range(3)]
    for run_id in ids:
        durable.cancel(run_id)
    _finished_long_ago(durable, ids[:2])
    # The third finished "in a minute": younger than any older_than, however slow the machine.
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == ids[2]).values(finished_at=durable.db.later(60)))
    for older_than in (30, 30.0, "30", " 30 ", "1800", "0.5"):
        assert durable.cleanup(older_than, dry_run=True)["runs"] == 2, older_than
    assert durable.cleanup("7200", dry_run=True)["runs"] == 0  # two hours: none is that old
    assert durable.cleanup("30", ["cancelled"])["runs"] == 2
    with durable.db.engine.connect() as conn:
        assert list(conn.execute(select(runs.c.id)).scalars()) == [ids[2]]


@pytest.mark.parametrize("older_than", ["0", "-30", "30x", "", "1e3"])
def test_cleanup_still_refuses_what_is_not_a_positive_duration(durable, older_than):
    """Guards issue 12: taking bare numbers, ``cleanup`` still refuses what is not a positive
    duration."""
    from durable_celery.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="older_than must be"):
        durable.cleanup(older_than, dry_run=True)


def test_cli_cleanup_older_than_a_bare_number_of_seconds(durable, tmp_path):
    """Guards issue 12: ``durable cleanup --older-than 30`` means 30 seconds, and ``--help``
    says so."""
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
