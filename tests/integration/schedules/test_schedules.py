"""Keyed schedules through the public API: fires by trigger_schedule (the same code a beat fire
runs in a worker), outcomes, the failure count, and run-time RedBeat entries."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
from celery import Celery
from celery.schedules import crontab

from durable_celery import (
    Durable,
    InvalidArgument,
    InvalidKey,
    KeyTaken,
    RateLimited,
    ScheduleNotFound,
    UnknownWorkflow,
    Unsupported,
)
from durable_celery import schedules as schedules_module
from durable_celery.store import node_rows
from durable_celery.store.db import utcnow
from durable_celery.testing import wait_for, worker
from tests.conftest import FAST, REDIS_URL

pytestmark = pytest.mark.timeout(60)


def define(durable, name="job", **options):
    """A one-step workflow that returns ``n``, fails when told to, or waits for ``gate``."""
    wf = durable.workflow(name, **options)
    gate = threading.Event()

    @wf.step
    def work(n=0, fail=False, hold=False):
        if hold:
            gate.wait(20)
        if fail:
            raise RuntimeError("told to fail")
        return n

    wf.gate = gate  # type: ignore[attr-defined]
    return wf


def configure(durable, **entries):
    durable.app.conf.beat_schedule = entries


def test_beat_entry_fires_with_the_key_and_use_existing_records_duplicates(durable):
    wf = define(durable)
    configure(durable, nightly=durable.beat_entry(wf, crontab(minute="0"), key="k", input={"n": 1}))
    (entry,) = durable.list_schedules()
    assert (entry.name, entry.key, entry.schedule, entry.source) == ("job:k", "k", "0 * * * *", "config")
    first = durable.trigger_schedule("nightly")  # by its beat_schedule name, or by "job:k"
    assert durable.get_run(first).key == "k"
    assert durable.trigger_schedule("job:k") == first  # the holder still runs: nothing new
    assert [r.id for r in durable.list_runs(key="k")] == [first]
    (dup,) = durable.activity(kinds=["key_duplicate"])
    assert dup.run_id == first and dup.details["outcome"] == "use_existing"
    state = durable.get_schedule("job:k")
    assert (state.last_outcome, state.last_run_id, state.failures) == ("duplicate", first, 0)
    with worker(durable):
        wait_for(durable, first)
        second = durable.trigger_schedule("nightly")
        assert second != first
        assert wait_for(durable, second).status == "completed"
    assert durable.get_schedule("nightly").last_outcome == "started"


def test_error_policy_fires_are_skipped_and_not_counted(durable):
    wf = define(durable, on_duplicate="error")
    configure(durable, every_minute=durable.beat_entry(wf, "* * * * *", key="k"))
    holder = durable.trigger_schedule("job:k")
    for _ in range(6):  # more than schedule_max_failures: skips never disable
        with pytest.raises(KeyTaken) as refused:
            durable.trigger_schedule("job:k")
        assert refused.value.holder_id == holder
    state = durable.get_schedule("job:k")
    assert (state.last_outcome, state.failures, state.enabled) == ("skipped", 0, True)
    assert len(durable.list_runs()) == 1


def test_fires_past_the_workflows_rate_limit_are_refused_and_not_counted(durable):
    wf = define(durable, rate_limit={"limit": 1, "period": 3600})
    configure(durable, often=durable.beat_entry(wf, "* * * * *", name="often"))
    first = durable.trigger_schedule("often")
    for _ in range(6):  # more than schedule_max_failures: a rate limit never disables
        with pytest.raises(RateLimited):
            durable.trigger_schedule("often")
    state = durable.get_schedule("often")
    assert (state.last_outcome, state.failures, state.enabled) == ("rate_limited", 0, True)
    assert [run.id for run in durable.list_runs()] == [first]


def test_five_failures_in_a_row_disable_and_a_success_resets(durable):
    wf = define(durable)
    configure(durable, flaky=durable.beat_entry(wf, 60, input={"fail": True}, name="flaky"))
    with worker(durable):
        for fire in range(5):  # a run's outcome counts at the schedule's next fire
            assert durable.get_schedule("flaky").failures == max(0, fire - 1)
            run_id = durable.trigger_schedule("flaky")
            assert wait_for(durable, run_id).status == "failed"
        with pytest.raises(InvalidArgument, match="disabled"):
            durable.trigger_schedule("flaky")  # judges the 5th failure and starts nothing
    state = durable.get_schedule("flaky")
    assert (state.enabled, state.failures, state.last_outcome) == (False, 5, "failed")
    assert state.next_fire_at is None
    (off,) = durable.activity(kinds=["schedule_disabled"])
    assert off.details["schedule"] == "flaky" and off.details["failures"] == 5
    assert off.workflow == "job"
    assert "flaky" in schedules_module.problems(durable.runtime)[0]
    runs_before = len(durable.list_runs())
    assert schedules_module.fire(
        durable.runtime, durable.app, **durable.app.conf.beat_schedule["flaky"]["kwargs"]
    ) == {
        "outcome": "disabled",
        "run_id": None,
    }
    assert len(durable.list_runs()) == runs_before
    assert durable.enable_schedule("flaky").failures == 0
    assert schedules_module.problems(durable.runtime) == []


def test_a_completed_run_resets_the_count(durable):
    wf = define(durable)
    configure(
        durable,
        bad=durable.beat_entry(wf, 60, input={"fail": True}, name="s"),
    )
    with worker(durable):
        for _ in range(2):
            wait_for(durable, durable.trigger_schedule("s"))
        configure(durable, good=durable.beat_entry(wf, 60, input={"n": 1}, name="s"))
        wait_for(durable, durable.trigger_schedule("s"))
        assert durable.get_schedule("s").failures == 2  # that run is judged at the next fire
        wait_for(durable, durable.trigger_schedule("s"))
    assert durable.get_schedule("s").failures == 0


def test_a_run_no_worker_picks_up_counts_as_a_failure(make_durable):
    producer = make_durable(schedule_pickup_timeout=0.5)
    wf = define(producer, "remote_job")
    configure(producer, remote=producer.beat_entry(wf, 60, key="r", name="remote"))
    # A worker without the workflow's code runs the fire: the run is created by name, since a
    # node with the code has been seen by this database (a rolling deploy).
    with producer.db.begin() as conn:
        node_rows.register_node_txn(producer.db, conn, "coded@test", ["q"], 1, {"remote_job": ["work"]})
    bare = make_durable("bare", schedule_pickup_timeout=0.5)
    kwargs = producer.app.conf.beat_schedule["remote"]["kwargs"]
    assert "remote_job" not in bare.workflows
    first = schedules_module.fire(bare.runtime, bare.app, **kwargs)
    assert first["outcome"] == "started"
    run = producer.get_run(first["run_id"])
    assert (run.workflow, run.key, run.status) == ("remote_job", "r", "pending")
    while (utcnow() - run.created_at).total_seconds() <= 0.5:
        time.sleep(0.05)
    second = schedules_module.fire(bare.runtime, bare.app, **kwargs)
    assert second["outcome"] == "started" and second["run_id"] != first["run_id"]
    assert producer.get_run(first["run_id"]).status == "cancelled"
    assert producer.get_schedule("remote").failures == 1
    with worker(producer):  # a node with the code sends the run the bare worker created
        assert wait_for(producer, second["run_id"]).status == "completed"


def test_bad_input_raises_and_writes_nothing(durable):
    wf = define(durable, key="job:{n}")
    with pytest.raises(UnknownWorkflow):
        durable.beat_entry("nope", 60)
    with pytest.raises(InvalidArgument, match="cron"):
        durable.beat_entry(wf, "61 * * * *", key="k")
    with pytest.raises(InvalidArgument):
        durable.beat_entry(wf, "every day", key="k")
    for bad in (0, -1, float("inf"), True, "--1 * * * *", "*/0 * * * *", "* * * *", None):
        with pytest.raises(InvalidArgument):
            durable.beat_entry(wf, bad, key="k")
    with pytest.raises(InvalidKey):
        durable.beat_entry(wf, 60, key="")
    with pytest.raises(InvalidKey):
        durable.beat_entry(wf, 60)  # the key template needs n
    with pytest.raises(UnknownWorkflow):
        durable.schedule("nope", "*/5 * * * *")
    with pytest.raises(InvalidKey):
        durable.schedule(wf, "*/5 * * * *", key="x" * 256)
    with pytest.raises(ScheduleNotFound):
        durable.trigger_schedule("none")
    with pytest.raises(ScheduleNotFound):
        durable.get_schedule("none")
    with pytest.raises(Unsupported, match="RedBeat"):
        durable.schedule(wf, 60, input={"n": 1})  # neither RedBeat nor DurableScheduler set up
    assert durable.beat_entry(wf, 60, input={"n": 3})["kwargs"]["key"] == "job:3"
    queued = durable.workflow("queued", queue="slow")
    queued.step(lambda: None, name="first")
    assert durable.beat_entry(queued, 60)["options"]["queue"] == "slow"
    assert durable.list_schedules() == []


@pytest.fixture
def redbeat_durable(pg_url, redis_client):
    """A Durable on PostgreSQL whose run-time schedules are RedBeat entries under their own prefix."""
    app = Celery("redbeat_tests", broker=REDIS_URL, set_as_current=True)
    app.conf.task_default_queue = f"q-{uuid.uuid4().hex[:8]}"
    app.conf.redbeat_redis_url = REDIS_URL
    app.conf.redbeat_key_prefix = f"test-redbeat-{uuid.uuid4().hex[:8]}:"
    durable = Durable(app, pg_url, **FAST)
    yield durable
    durable.db.dispose()


def test_run_time_schedules_are_redbeat_entries(redbeat_durable):
    from redbeat.schedulers import RedBeatSchedulerEntry

    durable = redbeat_durable
    wf = define(durable)
    configure(durable, nightly=durable.beat_entry(wf, "0 3 * * *", key="n"))
    for taken in ("nightly", "job:n"):  # a configured schedule's names
        with pytest.raises(InvalidArgument, match="beat_schedule"):
            durable.schedule(wf, 60, key="other", name=taken)
    configure(durable)
    made = durable.schedule(wf, "*/5 * * * *", key="k", input={"n": 1}, name="five")
    assert (made.source, made.schedule, made.key, made.input, made.enabled) == (
        "redbeat",
        "*/5 * * * *",
        "k",
        {"n": 1},
        True,
    )
    assert made.next_fire_at is not None and made.next_fire_at > utcnow()
    entry = RedBeatSchedulerEntry.from_key(durable.app.conf.redbeat_key_prefix + "five", app=durable.app)
    assert entry.task == "durable.fire_schedule" and entry.kwargs["key"] == "k"
    assert [s.name for s in durable.list_schedules()] == ["five"]

    changed = durable.update_schedule("five", 2, input={"n": 2})
    assert (changed.schedule, changed.input, changed.key) == ("every 2s", {"n": 2}, "k")
    assert durable.disable_schedule("five").enabled is False
    assert RedBeatSchedulerEntry.from_key(entry.key, app=durable.app).enabled is False
    assert durable.enable_schedule("five").enabled is True

    run_id = durable.trigger_schedule("five")
    assert durable.get_run(run_id).input == {"n": 2}
    assert durable.get_schedule("five").last_run_id == run_id

    assert durable.delete_schedule("five") is True
    with pytest.raises(KeyError):
        RedBeatSchedulerEntry.from_key(entry.key, app=durable.app)
    assert durable.list_schedules() == []
    assert durable.delete_schedule("five") is False
    late = schedules_module.fire(
        durable.runtime, durable.app, **entry.kwargs
    )  # a fire beat sent before the delete
    assert late == {"outcome": "deleted", "run_id": None}
    assert durable.list_schedules() == [] and len(durable.list_runs()) == 1


def test_a_beat_back_from_downtime_fires_once_not_once_per_missed_slot(redbeat_durable, redis_client):
    from celery.beat import Scheduler
    from redbeat import RedBeatScheduler

    durable = redbeat_durable
    durable.app.conf.redbeat_lock_key = None  # one in-process scheduler: no beat lock
    wf = define(durable)
    durable.schedule(wf, "* * * * *", key="k", name="minutely")
    durable.app.conf.beat_schedule = {"hourly": durable.beat_entry(wf, "0 * * * *", key="h")}
    queue = durable.app.conf.task_default_queue
    five_slots_ago = durable.app.now() - timedelta(minutes=5, seconds=1)
    hours_ago = durable.app.now() - timedelta(hours=3, seconds=1)

    redbeat = RedBeatScheduler(app=durable.app)
    # Beat was down 5 minutes. (Not through redbeat.schedule: it holds only entries due within
    # beat_max_loop_interval, 5 s by Durable's default.)
    schedules_module.redbeat_entry(durable.app, "minutely").reschedule(last_run_at=five_slots_ago)
    for _ in range(3):
        redbeat.tick()
    assert redis_client.llen(queue) == 1

    default = Scheduler(app=durable.app)  # Celery's own scheduler, as on the embedded default
    default.schedule["hourly"].last_run_at = hours_ago
    for _ in range(3):
        default.tick()
    assert redis_client.llen(queue) == 2
    redis_client.delete(queue)
