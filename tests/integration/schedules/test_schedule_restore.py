"""A run-time schedule whose RedBeat entry vanished (a flushed Redis): doctor reports it as
``schedule_missing``, and ``doctor --fix`` or the workers' upkeep re-creates it from
``durable_schedules`` without firing a missed slot more than once."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from celery import Celery
from sqlalchemy import update

from durable_celery import Durable
from durable_celery.schedules import restore_schedules_once
from durable_celery.store.db import utcnow
from durable_celery.store.schema import schedules as schedules_table
from durable_celery.worker import upkeep
from tests.conftest import FAST, REDIS_URL
from tests.integration.worker.helpers import running_upkeep, until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def redbeat_durable(pg_url, redis_client):
    """A Durable on PostgreSQL whose run-time schedules are RedBeat entries under their own prefix."""
    app = Celery("restore_tests", broker=REDIS_URL, set_as_current=True)
    app.conf.task_default_queue = f"q-{uuid.uuid4().hex[:8]}"
    app.conf.redbeat_redis_url = REDIS_URL
    app.conf.redbeat_key_prefix = f"test-restore-{uuid.uuid4().hex[:8]}:"
    durable = Durable(app, pg_url, **FAST)
    yield durable
    durable.db.dispose()


def define(durable):
    wf = durable.workflow("job")

    @wf.step
    def work(n=0):
        return n

    return wf


def vanish(durable, redis_client, name):
    """What a flushed Redis leaves of a RedBeat entry: nothing, neither its hash nor its score."""
    prefix = durable.app.conf.redbeat_key_prefix
    redis_client.zrem(prefix + ":schedule", prefix + name)
    redis_client.delete(prefix + name)


def missing(durable):
    return [f for f in durable.doctor() if f.kind == "schedule_missing"]


def test_doctor_reports_a_vanished_entry_and_fix_restores_it(redbeat_durable, redis_client):
    durable = redbeat_durable
    wf = define(durable)
    durable.schedule(wf, "* * * * *", key="k", name="minutely")
    durable.schedule(wf, 60, key="off", name="switched-off")
    durable.disable_schedule("switched-off")
    durable.app.conf.beat_schedule = {"hourly": durable.beat_entry(wf, "0 * * * *", key="h")}
    durable.trigger_schedule("hourly")  # a configured schedule has a row too, and no RedBeat entry
    assert missing(durable) == []

    vanish(durable, redis_client, "minutely")
    vanish(durable, redis_client, "switched-off")  # disabled: nothing to fire, nothing missing
    (finding,) = missing(durable)
    assert (finding.fixable, finding.workflow, finding.details) == (
        True,
        "job",
        {"schedule": "minutely", "key": "k"},
    )

    fixed = [f for f in durable.doctor(fix=True) if f.kind == "schedule_missing"]
    assert [(f.details["schedule"], f.fixed) for f in fixed] == [("minutely", True)]
    assert missing(durable) == []
    before = utcnow()
    shown = durable.get_schedule("minutely")
    assert (shown.source, shown.key, shown.schedule, shown.enabled) == ("redbeat", "k", "* * * * *", True)
    # Counted from its creation (it never fired): its next minute, never a time already past
    # (exactly now only if a minute began since it was created: then it is due).
    nxt = shown.next_fire_at
    assert nxt is not None and before <= nxt <= utcnow() + timedelta(minutes=1)
    assert [s.name for s in durable.list_schedules()] == ["job:h", "minutely", "switched-off"]


def test_a_restored_entry_shows_its_next_fire_counted_from_now(redbeat_durable, redis_client):
    """Its next fire is the time left after its last fire, from now: never a time already past."""
    durable = redbeat_durable
    wf = define(durable)
    durable.schedule(wf, 60, key="k", name="every-minute")
    with durable.db.begin() as conn:  # fired 50 s ago: 10 s left of its minute
        conn.execute(
            update(schedules_table)
            .where(schedules_table.c.name == "every-minute")
            .values(last_fire_at=utcnow() - timedelta(seconds=50))
        )
    vanish(durable, redis_client, "every-minute")
    assert restore_schedules_once(durable.runtime, durable.app) == 1
    nxt = durable.get_schedule("every-minute").next_fire_at
    assert nxt is not None and utcnow() + timedelta(seconds=5) < nxt <= utcnow() + timedelta(seconds=10)


def test_upkeep_restores_an_entry_and_a_missed_slot_fires_once(redbeat_durable, redis_client):
    from redbeat import RedBeatScheduler

    durable = redbeat_durable
    durable.app.conf.redbeat_lock_key = None  # one in-process scheduler: no beat lock
    wf = define(durable)
    durable.schedule(wf, "* * * * *", key="k", name="minutely")
    durable.schedule(wf, 3600, key="rare", name="hourly")
    assert restore_schedules_once(durable.runtime, durable.app) == 0  # nothing gone, nothing written
    with durable.db.begin() as conn:  # last fired five minutes ago, then Redis was flushed
        conn.execute(
            update(schedules_table)
            .where(schedules_table.c.name == "minutely")
            .values(last_fire_at=utcnow() - timedelta(minutes=5, seconds=1))
        )
    vanish(durable, redis_client, "minutely")
    vanish(durable, redis_client, "hourly")

    assert restore_schedules_once(durable.runtime, durable.app) == 2
    assert restore_schedules_once(durable.runtime, durable.app) == 0
    assert missing(durable) == []
    queue = durable.app.conf.task_default_queue
    redbeat = RedBeatScheduler(app=durable.app)
    for _ in range(3):
        redbeat.tick()
    assert redis_client.llen(queue) == 1  # the missed minute, once; the hourly one waits its hour
    before = utcnow()
    nxt = durable.get_schedule("minutely").next_fire_at
    assert nxt is not None and before <= nxt <= utcnow() + timedelta(minutes=1)
    redis_client.delete(queue)


@pytest.mark.parametrize("backend", ["postgres"])  # RedBeat entries live in Redis
def test_the_sweep_restores_a_vanished_redbeat_entry(pg_url, redis_client, backend):
    """Guards mutants of durable_celery/worker/upkeep.py: the sweeper thread of an ``Upkeep``
    driven in this process restores the entry."""
    from celery import Celery

    from durable_celery import Durable
    from tests.conftest import FAST, REDIS_URL

    app = Celery("restore_upkeep", broker=REDIS_URL)
    app.conf.task_default_queue = f"q-{uuid.uuid4().hex[:8]}"
    app.conf.redbeat_redis_url = REDIS_URL
    app.conf.redbeat_key_prefix = f"test-upkeep-{uuid.uuid4().hex[:8]}:"
    durable = Durable(app, pg_url, **{**FAST, "poll_interval": 0.05, "sweep_interval": 0.3})
    try:
        durable.schedule(define(durable), "* * * * *", key="k", name="minutely")
        vanish(durable, redis_client, "minutely")
        assert len(missing(durable)) == 1
        with running_upkeep(upkeep.Upkeep(durable.runtime, durable.engine, durable.app)):
            until(lambda: missing(durable) == [], "the entry restored")
    finally:
        durable.db.dispose()
