"""Settings that work but invite trouble are said once, when the Durable is made."""

from __future__ import annotations

import logging

import pytest
from celery import Celery

from durable_celery import Durable


@pytest.mark.parametrize(
    ("stale", "beat", "warned"),
    [(1.0, 0.5, True), (2.9, 1.0, True), (3.0, 1.0, False), (None, None, False)],
    ids=["under", "just_under", "three_times", "defaults"],
)
def test_a_stale_lock_timeout_under_three_heartbeats_is_warned_at_start(
    caplog, tmp_path, stale, beat, warned
):
    given = {} if stale is None else {"stale_lock_timeout": stale, "heartbeat_interval": beat}
    with caplog.at_level(logging.WARNING, logger="durable_celery"):
        durable = Durable(
            Celery("warned", broker="memory://"), f"sqlite:///{tmp_path}/d.sqlite3", upkeep=False, **given
        )
    said = [r.getMessage() for r in caplog.records if "stale_lock_timeout" in r.getMessage()]
    if warned:
        assert said == [
            f"durable: stale_lock_timeout ({stale}s) is under 3 x heartbeat_interval ({beat}s): "
            "a slow heartbeat may hand a live step to another worker"
        ]
    else:
        assert said == []
    durable.db.dispose()
