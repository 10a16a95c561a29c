"""The worker's app: ``celery -A tests.chaos.app worker``, configured by the environment the
harness gives it (``CHAOS_BROKER``, ``CHAOS_DB``, ``CHAOS_QUEUE``, ``CHAOS_WORKER``,
``CHAOS_SETTINGS`` as JSON)."""

from __future__ import annotations

import json
import os

from celery import Celery

from durable_celery import Durable
from tests.chaos.workflows import Ledger, define

app = Celery("chaosapp", broker=os.environ["CHAOS_BROKER"])
app.conf.task_default_queue = os.environ["CHAOS_QUEUE"]
app.conf.broker_connection_retry_on_startup = True
app.conf.worker_prefetch_multiplier = 1
durable = Durable(app, os.environ["CHAOS_DB"], **json.loads(os.environ["CHAOS_SETTINGS"]))
ledger = Ledger(os.environ["CHAOS_DB"], os.environ["CHAOS_WORKER"])
ledger.connect()
define(durable, ledger)
