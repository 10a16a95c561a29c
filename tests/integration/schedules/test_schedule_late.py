"""When a schedule counts as late (beat not firing it): overdue by more than its period plus the
margin, for interval and cron schedules, read from the state a beat or a worker left; and how
``doctor`` and the gauge say so. The beat itself is stopped for real in
tests/e2e/test_beat_down.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update

from durable_celery.store.schema import schedules

pytestmark = pytest.mark.timeout(60)


def last_fired(durable, name, seconds_ago):
    """Set a schedule's last fire (what a worker records) to ``seconds_ago``."""
    at = durable.db.utcnow() - timedelta(seconds=seconds_ago)
    with durable.db.begin() as conn:
        conn.execute(update(schedules).where(schedules.c.name == name).values(last_fire_at=at))


@pytest.fixture
def durable(make_durable):
    d = make_durable()
    d.app.conf.beat_scheduler = "durable_celery.beat:DurableScheduler"
    d.workflow("tick").step(lambda: None, name="work")
    return d


def test_interval_and_cron_schedules_are_late_past_their_period_plus_the_margin(durable):
    durable.schedule("tick", 30, key="every", name="every")
    durable.schedule("tick", "* * * * *", key="cron", name="cron")
    assert [(s.name, s.late, s.overdue_seconds) for s in durable.list_schedules()] == [
        ("cron", False, 0.0),
        ("every", False, 0.0),
    ]
    # 30 s period, margin 10 s + beat's loop (5 s): late once 45 s past the fire due.
    last_fired(durable, "every", 30 + 40)
    every = durable.get_schedule("every")
    assert not every.late and 39 < every.overdue_seconds < 45
    assert every.next_fire_at is not None  # "now": it is due
    last_fired(durable, "every", 30 + 50)
    assert durable.get_schedule("every").late
    # A cron slot each minute: a fire 20 s ago is due at most 20 s; 200 s ago, two slots missed.
    last_fired(durable, "cron", 20)
    cron = durable.get_schedule("cron")
    assert not cron.late and cron.overdue_seconds <= 20
    last_fired(durable, "cron", 200)
    cron = durable.get_schedule("cron")
    assert cron.late and 140 <= cron.overdue_seconds <= 200
    durable.disable_schedule("every")  # a schedule switched off is never late
    assert [s.name for s in durable.list_schedules() if s.late] == ["cron"]


def test_doctor_and_the_gauge_report_a_late_schedule(durable):
    durable.schedule("tick", 10, key="k", name="ten")
    assert [f for f in durable.doctor() if f.kind == "schedule_late"] == []
    assert durable.metrics.value("durable_schedules_late") == 0
    last_fired(durable, "ten", 60)
    (finding,) = [f for f in durable.doctor() if f.kind == "schedule_late"]
    assert finding.workflow == "tick" and finding.details["schedule"] == "ten"
    assert 49 < finding.details["overdue_seconds"] < 55 and not finding.fixable
    assert "is `celery beat -S durable_celery.beat:DurableScheduler` running?" in finding.message
    assert durable.metrics.value("durable_schedules_late") == 1
    durable.trigger_schedule("ten")  # a fire, as beat's would be, ends it
    assert not durable.get_schedule("ten").late
    assert [f for f in durable.doctor() if f.kind == "schedule_late"] == []
