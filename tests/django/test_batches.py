"""A batch workflow's start inside ``transaction.atomic()``: it joins its batch with Django's
transaction, and a rolled-back start (a savepoint's too) is in no batch. Real Django, PostgreSQL,
Redis and an in-process Celery worker."""

from __future__ import annotations

import pytest

from durable_celery import RunNotFound
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(120)


class Boom(Exception):
    pass


def test_starts_inside_atomic_join_their_batch_and_a_rolled_back_one_is_in_none(durable):
    from django.db import transaction

    from tests.django.shop.models import Order
    from tests.django.shop.workflows import invoice_lines

    with transaction.atomic():
        first = Order.objects.create(item="pen", details={})
        run_id = invoice_lines.start({"customer": "c1", "order_id": first.pk})
    with pytest.raises(Boom), transaction.atomic():  # joins, then rolls back with its order
        dropped = Order.objects.create(item="ink", details={})
        assert invoice_lines.start({"customer": "c1", "order_id": dropped.pk}) == run_id
        raise Boom
    with transaction.atomic():
        kept = Order.objects.create(item="pad", details={})
        assert invoice_lines.start({"customer": "c1", "order_id": kept.pk}) == run_id
        with pytest.raises(Boom), transaction.atomic():  # a savepoint opening another batch
            other = invoice_lines.start({"customer": "c2", "order_id": kept.pk})
            raise Boom
    with pytest.raises(RunNotFound):
        durable.get_run(other)
    with worker(durable):
        run = wait_for(durable, run_id, timeout=30)
    assert run.status == "completed" and run.output == {"lines": [first.pk, kept.pk]}
    assert [item["order_id"] for item in run.input["items"]] == [first.pk, kept.pk]
