"""A start inside ``transaction.atomic()`` joins Django's transaction: the run and its key claim
commit or roll back with the caller's rows, savepoints included, and the first message goes out
from ``on_commit``. Real Django, PostgreSQL, Redis and an in-process Celery worker."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery

from durable_celery import KeyTaken, RunNotFound, SendEvent
from durable_celery.store import queries
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(120)


class Boom(Exception):
    pass


def _order(item: str = "book") -> Any:
    from tests.django.shop.models import Order

    return Order.objects.create(item=item, details={"gift": True, "lines": [1, 2]})


def _queued(durable: Any, redis_client: Any) -> int:
    assert durable.flush(timeout=10)
    return int(redis_client.llen(durable.app.conf.task_default_queue))


def test_a_start_inside_atomic_commits_with_the_callers_rows_and_a_worker_runs_it(durable):
    from django.db import transaction

    from tests.django.shop.models import Order
    from tests.django.shop.workflows import fulfil

    with transaction.atomic():
        order = _order()
        run_id = fulfil.start({"order_id": order.pk})
        with pytest.raises(RunNotFound):  # durable's own pool cannot see it before the commit
            durable.get_run(run_id)
    assert durable.get_run(run_id).key == f"order:{order.pk}"
    with worker(durable):  # the relay waits relay_after (120 s): on_commit sent the message
        run = wait_for(durable, run_id, timeout=30)
    assert run.status == "completed" and run.output == {"item": "book"}
    assert Order.objects.get(pk=order.pk).fulfilled is True


def test_a_rollback_removes_the_run_and_its_key_claim_and_sends_nothing(durable, redis_client):
    from django.db import transaction

    from tests.django.shop.models import Order
    from tests.django.shop.workflows import fulfil

    before = _queued(durable, redis_client)
    with pytest.raises(Boom), transaction.atomic():
        order = _order()
        run_id = fulfil.start({"order_id": order.pk})
        raise Boom
    assert not Order.objects.filter(pk=order.pk).exists()
    with pytest.raises(RunNotFound):
        durable.get_run(run_id)
    assert _queued(durable, redis_client) == before  # nothing was published
    again = fulfil.start({"order_id": order.pk})  # the key is free: a new run takes it
    assert again != run_id and durable.get_run(again).holds_key


def test_a_savepoint_rollback_removes_only_the_run_started_inside_it(durable):
    from django.db import transaction

    from tests.django.shop.workflows import fulfil

    with transaction.atomic():
        kept, dropped = _order("kept"), _order("dropped")
        outer = fulfil.start({"order_id": kept.pk})
        with pytest.raises(Boom), transaction.atomic():  # a savepoint
            inner = fulfil.start({"order_id": dropped.pk})
            raise Boom
    assert durable.get_run(outer).status in ("pending", "running", "completed")
    with pytest.raises(RunNotFound):
        durable.get_run(inner)
    assert fulfil.start({"order_id": dropped.pk}) != inner  # its key claim went with the savepoint


def test_a_duplicate_returns_the_holder_and_key_taken_leaves_the_block_usable(durable):
    from django.db import transaction

    from tests.django.shop.models import Order
    from tests.django.shop.workflows import fulfil

    with transaction.atomic():
        order = _order()
        first = fulfil.start({"order_id": order.pk})
        assert fulfil.start({"order_id": order.pk}) == first  # use_existing, inside the block
        with pytest.raises(KeyTaken) as refused:
            fulfil.start({"order_id": order.pk}, on_duplicate="error")
        assert refused.value.holder_id == first
        after = Order.objects.create(item="after the refusal")  # the transaction goes on
    assert Order.objects.filter(pk=after.pk).exists()
    assert durable.get_run(first).holds_key


def _outcome(durable: Any, starts: list[Any]) -> list[Any]:
    """What a sequence of starts came to, by position: ids named by the start that made them."""
    names: dict[str, str] = {}
    shown = []
    for n, got in enumerate(starts):
        if isinstance(got, BaseException):
            shown.append(type(got).__name__)
            continue
        names.setdefault(got, f"run{n}")
        run = durable.get_run(got)
        shown.append((names[got], run.status, run.holds_key, names.get(run.runs_after_id or "")))
    return shown


POLICIES = ["use_existing", "error", "cancel_existing", "run_again", "debounce", "send_event"]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_answers_inside_atomic_as_on_durables_own_connection(durable, policy):
    from django.db import transaction

    name = f"pol_{policy}_{uuid.uuid4().hex[:6]}"
    options: dict[str, Any] = {"reuse": "after_close"}
    if policy == "debounce":
        options["debounce"] = {"period": 60}
    elif policy == "send_event":
        options["on_duplicate"] = SendEvent("again")
    else:
        options["on_duplicate"] = policy
    wf = durable.workflow(name, **options)
    wf.step(lambda n: n, name="only")

    def sequence(key: str) -> list[Any]:
        got: list[Any] = []
        for n in range(3):
            try:
                got.append(wf.start({"n": n}, key=key))
            except KeyTaken as exc:
                got.append(exc)
        return got

    outside = _outcome(durable, sequence(f"out-{uuid.uuid4().hex[:6]}"))
    with transaction.atomic():
        inside_starts = sequence(f"in-{uuid.uuid4().hex[:6]}")
    assert _outcome(durable, inside_starts) == outside
    if policy == "debounce":  # the folded input is the newest, as outside
        assert durable.get_run(inside_starts[0]).input == {"n": 2}


def test_json_is_read_as_values_on_djangos_connection_and_djangos_own_handling_is_unchanged(durable):
    from django.db import connection, transaction

    from tests.django.shop.models import Order
    from tests.django.shop.workflows import fulfil

    with transaction.atomic():
        order = _order()
        run_id = fulfil.start({"order_id": order.pk})
        # A duplicate reads the holder's input on Django's connection to compare it.
        assert fulfil.start({"order_id": order.pk}) == run_id
        assert Order.objects.get(pk=order.pk).details == {"gift": True, "lines": [1, 2]}
        with connection.cursor() as cursor:  # Django's own cursors: Django's loaders, text
            cursor.execute("SELECT input FROM durable_runs WHERE id = %s", [run_id])
            assert cursor.fetchone()[0] == f'{{"order_id": {order.pk}}}'
    duplicate = [a for a in durable.activity(kinds=["key_duplicate"], run_id=run_id)]
    assert duplicate and duplicate[0].details["input_changed"] is False


def test_a_start_works_after_django_closed_its_connection(durable):
    from django.db import connection, transaction

    from tests.django.shop.workflows import fulfil

    connection.close()  # what Django does between requests
    with transaction.atomic():
        order = _order()
        run_id = fulfil.start({"order_id": order.pk})
    connection.close()
    assert durable.get_run(run_id).holds_key
    with transaction.atomic():
        assert fulfil.start({"order_id": order.pk}) == run_id


def test_a_broker_down_at_commit_leaves_the_run_to_the_relay(durable, redis_client):
    from django.db import transaction

    from durable_celery.contrib.django import DjangoDurable
    from durable_celery.contrib.django import durable as module
    from durable_celery.worker.relay import relay_once
    from tests.conftest import _spare_port

    made = dict(module._made)
    app = Celery("down", broker=f"redis://127.0.0.1:{_spare_port()}/0", set_as_current=False)
    app.conf.task_default_queue = durable.app.conf.task_default_queue
    app.conf.broker_connection_timeout = 1
    down = DjangoDurable(app, publish_in_background=False, publish_retries=0, upkeep=False)
    try:
        name = f"down_{uuid.uuid4().hex[:6]}"
        wf = down.workflow(name)
        wf.step(lambda order_id: order_id, name="only")
        durable.workflow(name).step(lambda order_id: order_id, name="only")  # a node that has the code
        with transaction.atomic():
            order = _order()
            run_id = wf.start({"order_id": order.pk}, key=f"down:{order.pk}")
        # Committed with the caller's rows; the message could not go: flagged for the relay.
        assert down.get_run(run_id).status == "pending"
        with down.db.engine.connect() as conn:
            assert queries.fetch_run(conn, run_id).published is False
        before = _queued(durable, redis_client)
        assert relay_once(durable.runtime, durable.app) >= 1  # a relay that reaches the broker sends it
        assert _queued(durable, redis_client) > before
        with down.db.engine.connect() as conn:
            assert queries.fetch_run(conn, run_id).published is True
    finally:
        down.db.dispose()
        module._made.clear()
        module._made.update(made)


def test_the_explicit_django_connection_joins_and_publishes_on_commit(durable, redis_client):
    from django.db import transaction

    from durable_celery.contrib.django import django_connection
    from tests.django.shop.workflows import fulfil

    durable.join_atomic = False  # only the explicit form joins now
    try:
        before = _queued(durable, redis_client)
        with pytest.raises(Boom), transaction.atomic():
            dropped = fulfil.start({"order_id": _order().pk}, connection=django_connection())
            raise Boom
        with pytest.raises(RunNotFound):
            durable.get_run(dropped)
        with transaction.atomic():
            run_id = fulfil.start({"order_id": _order().pk}, connection=django_connection("default"))
            assert _queued(durable, redis_client) == before  # nothing sent before the commit
        assert _queued(durable, redis_client) == before + 1  # sent from on_commit
        assert durable.get_run(run_id).holds_key
    finally:
        durable.join_atomic = True


def test_the_explicit_form_outside_atomic_is_refused_and_writes_nothing(durable):
    from durable_celery import InvalidArgument
    from durable_celery.contrib.django import django_connection
    from tests.django.shop.workflows import fulfil

    key = f"order:outside-{uuid.uuid4().hex[:6]}"
    with pytest.raises(InvalidArgument, match="transaction.atomic"):
        fulfil.start({"order_id": 1}, key=key, connection=django_connection())
    assert durable.list_runs(key=key) == []


def test_a_rate_limited_start_inside_atomic_writes_nothing_and_leaves_the_transaction_usable(durable):
    from django.db import transaction

    from durable_celery import RateLimited
    from tests.django.shop.models import Order

    name = f"remind_{uuid.uuid4().hex[:8]}"
    remind = durable.workflow(name, key="o:{order_id}", rate_limit={"limit": 1, "period": 3600})

    @remind.step
    def send(order_id):
        return order_id

    with transaction.atomic():
        order, other = _order(), _order("other")
        first = remind.start({"order_id": order.pk})
        with pytest.raises(RateLimited) as refused:
            remind.start({"order_id": other.pk})
        assert refused.value.retry_after > 3500
        order.item = "still usable"
        order.save(update_fields=["item"])
    assert Order.objects.get(pk=order.pk).item == "still usable"
    assert [run.id for run in durable.list_runs(workflow=name)] == [first]
    assert durable.get_run(first).holds_key
