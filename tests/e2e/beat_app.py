"""The app that `celery beat`, `celery worker` and `celery flower` run in tests/e2e/test_beat_flower.py.

Everything comes from the environment the test gives: with BEAT_APP_BROKER it runs on
PostgreSQL + Redis with RedBeat; without, on the embedded default (SQLite and the serverless
broker under DURABLE_HOME) with Celery's default scheduler.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from durable_celery import Durable

broker = os.environ.get("BEAT_APP_BROKER")
app = Celery("beat_app", broker=broker)
app.conf.task_default_queue = os.environ.get("BEAT_APP_QUEUE", "celery")
app.conf.beat_max_loop_interval = 0.5  # sees run-time schedules within half a second
app.conf.worker_send_task_events = True  # what Flower shows
app.conf.task_send_sent_event = True
app.conf.broker_connection_retry_on_startup = True
if broker:
    app.conf.redbeat_redis_url = broker
    app.conf.redbeat_key_prefix = os.environ["BEAT_APP_PREFIX"]

durable = Durable(app, poll_interval=0.2, heartbeat_interval=0.5, relay_after=30.0)


def define(name: str, **options: object) -> None:
    """A one-step workflow that sleeps ``seconds`` and returns ``n``, or fails when told to."""
    wf = durable.workflow(name, **options)

    @wf.step
    def work(n: int = 0, seconds: float = 0.0, fail: bool = False) -> int:
        time.sleep(seconds)
        if fail:
            raise RuntimeError("told to fail")
        return n


define("slow")  # on_duplicate="use_existing"
define("strict", on_duplicate="error")
define("quick")
define("failing")

app.conf.beat_schedule = {
    "slow-every-second": durable.beat_entry("slow", 1, key="tick", input={"seconds": 2.5}),
    "strict-every-second": durable.beat_entry("strict", 1, key="only", input={"seconds": 2.5}),
    "failing-every-second": durable.beat_entry("failing", 1, key="f", input={"fail": True}),
}
