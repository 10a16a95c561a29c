"""Workers get the consumer that outlives a broker restart, unless the app chose its own."""

from __future__ import annotations

import logging

from celery import Celery

from durable_celery.worker import broker_reconnect


class OwnConsumer(broker_reconnect.Consumer):
    """A user's consumer built on ours."""


def test_durable_apps_get_the_reconnecting_consumer(tmp_path):
    from durable_celery import Durable

    app = Celery("reconnect", broker="memory://")
    durable = Durable(app, f"sqlite:///{tmp_path}/d.sqlite3", upkeep=False)
    assert app.conf.worker_consumer == broker_reconnect.CONSUMER
    durable.db.dispose()


def test_a_consumer_of_the_users_own_is_kept_and_warned_about_unless_it_derives_from_ours(caplog):
    derived = Celery("derived", broker="memory://")
    derived.conf.worker_consumer = f"{__name__}:OwnConsumer"
    with caplog.at_level(logging.WARNING, logger="durable_celery"):
        broker_reconnect.install(derived)
    assert derived.conf.worker_consumer == f"{__name__}:OwnConsumer" and caplog.text == ""

    plain = Celery("plain", broker="memory://")
    plain.conf.worker_consumer = "celery.worker.consumer.consumer:Consumer"
    with caplog.at_level(logging.WARNING, logger="durable_celery"):
        broker_reconnect.install(plain)
    assert plain.conf.worker_consumer == "celery.worker.consumer.consumer:Consumer"
    assert "does not subclass" in caplog.text
