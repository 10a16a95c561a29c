"""Schedule text: what durable.beat_entry and durable.schedule accept, and how it is stored."""

from __future__ import annotations

from datetime import timedelta

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from durable_celery import InvalidArgument
from durable_celery.schedules import fire_options, parse_schedule

app = Celery("text", broker="memory://")


@pytest.mark.parametrize(
    ("given", "text"),
    [
        ("*/5 * * * *", "*/5 * * * *"),
        ("  0   3 * * mon-fri ", "0 3 * * mon-fri"),
        (crontab(minute="*/15", hour="9-17"), "*/15 9-17 * * *"),
        (30, "every 30s"),
        (1.5, "every 1.5s"),
        (timedelta(minutes=2), "every 120s"),
        (schedule(timedelta(seconds=5)), "every 5s"),
        ("every 5s", "every 5s"),
    ],
)
def test_schedules_and_their_text(given, text):
    sched, stored = parse_schedule(app, given)
    assert stored == text
    again, same = parse_schedule(app, stored)  # the stored text reads back as the same schedule
    assert same == text and type(again) is type(sched)


@pytest.mark.parametrize(
    "bad", ["", "* * * *", "61 * * * *", "*/0 * * * *", "--1 * * * *", "every day", 0, -5, True, None, []]
)
def test_bad_schedules_raise_invalid_argument(bad):
    with pytest.raises(InvalidArgument):
        parse_schedule(app, bad)


def test_fires_show_schedule_workflow_and_key_and_intervals_expire():
    kwargs = {"name": "sync-7", "workflow": "sync", "key": "k", "input": {"secret": 1}}
    options = fire_options(parse_schedule(app, 30)[0], kwargs)
    assert options == {
        "argsrepr": "()",
        "kwargsrepr": "{schedule: sync-7, workflow: sync, key: 'k'}",
        "expires": 30.0,
    }
    assert "expires" not in fire_options(parse_schedule(app, "0 3 * * *")[0], kwargs)
    assert fire_options(parse_schedule(app, 1)[0], kwargs)["expires"] == 10.0
    queued = fire_options(parse_schedule(app, 60)[0], {**kwargs, "policy": {"queue": "slow"}})
    assert queued["queue"] == "slow"  # the queue of the workflow's first step
