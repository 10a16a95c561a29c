"""Guards issue 39: ``DurableTransactionTestCase`` sends durable's messages under a broker
namespace of the test session's own, so a developer's ``celery -A proj worker`` on the same
Redis never takes them (it would drop them as unknown runs, and the test would time out)."""

from __future__ import annotations

import io
import unittest
from typing import Any

import pytest

from durable_celery.testing import wait_for, worker
from durable_celery.worker.isolation import SESSION

pytestmark = pytest.mark.timeout(120)


def test_a_durable_test_case_keeps_its_messages_to_the_session(durable: Any, redis_client: Any) -> None:
    from django.db import transaction

    from durable_celery.contrib.django.testing import DurableTransactionTestCase
    from tests.django.shop.models import Order
    from tests.django.shop.workflows import fulfil

    queue = durable.app.conf.task_default_queue
    seen: dict[str, Any] = {}

    class OrderTests(DurableTransactionTestCase):
        def test_an_order_is_fulfilled(self) -> None:
            plain = redis_client.llen(queue)  # what earlier tests left in the project's queue
            with transaction.atomic():
                order = Order.objects.create(item="mug")
                run_id = fulfil.start({"order_id": order.pk})
            self.assertTrue(self.durable.flush(timeout=10))
            seen["prefixed"] = redis_client.llen(f"{SESSION}{queue}")
            seen["plain"] = redis_client.llen(queue) - plain
            with worker(self.durable):
                seen["run"] = wait_for(self.durable, run_id, timeout=30)

    options = dict(durable.app.conf.broker_transport_options or {})
    try:
        result = unittest.TextTestRunner(stream=io.StringIO()).run(
            unittest.defaultTestLoader.loadTestsFromTestCase(OrderTests)
        )
        assert result.wasSuccessful(), [text for _, text in result.errors + result.failures]
        # The message waited under the session's prefix, where no worker outside it looks.
        assert (seen["prefixed"], seen["plain"]) == (1, 0)
        assert seen["run"].status == "completed" and seen["run"].output == {"item": "mug"}
    finally:  # the other Django tests read the plain queue: give the project its broker back
        durable.app.conf.broker_transport_options = options
        durable.publisher.reconnect()
