"""A start whose input does not fit the steps, or cannot be stored, is refused before anything is
written, with the same error on PostgreSQL and SQLite (issue 12, items 2 and 3)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from sqlalchemy import func, select, update

from durable_celery import (
    Durable,
    InvalidDefinition,
    InvalidKey,
    InvalidStart,
    SendEvent,
    current_run,
)
from durable_celery.inputs import MAX_INPUT_DEPTH
from durable_celery.schedules.fires import start_fire
from durable_celery.store.schema import activity, events, keys, runs, steps
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(60)


def counts(durable: Any) -> dict[str, int]:
    """Rows in every table a start can write."""
    with durable.db.engine.connect() as conn:
        return {
            t.name: conn.execute(select(func.count()).select_from(t)).scalar_one()
            for t in (runs, steps, keys, activity, events)
        }


def refused(durable: Any, error: type[Exception], *words: str, start: Any = None, **call: Any) -> str:
    """Start with ``call``; assert ``error`` naming ``words``, and that no row was written."""
    before = counts(durable)
    with pytest.raises(error) as caught:
        (start or durable.start)(**call)
    message = str(caught.value)
    for word in words:
        assert word in message, message
    assert counts(durable) == before
    return message


def nested(levels: int) -> dict[str, Any]:
    """An input of ``levels`` nested mappings (the input itself is the first)."""
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"n": value}
    return value


@pytest.fixture
def shop(durable):
    charge = durable.workflow("charge")

    @charge.step
    def reserve(order, quantity=1):
        return quantity

    def refund(order, amount=0, quantity=1):
        pass

    @charge.step(compensate=refund)
    def pay(order, amount=0, quantity=1):
        return amount

    anything = durable.workflow("anything")

    @anything.step
    def take(**fields):
        return len(fields)

    return durable


# -- item 2: the input fits every step's signature --------------------------------------------


def test_an_input_every_step_takes_starts(shop):
    run_id = shop.start("charge", {"order": 1})
    assert shop.get_run(run_id).input == {"order": 1}
    shop.start("charge", {"order": 2, "quantity": 3})  # a parameter with a default is optional
    shop.start("anything", {"tag": "x", "whatever": [1, {"deep": None}]})  # **kwargs takes anything
    assert len(shop.list_runs()) == 3


def test_a_field_a_step_does_not_take_is_refused_naming_step_and_field(shop):
    message = refused(
        shop,
        InvalidStart,
        "'charge'",
        "step 'reserve'",
        "'amount'",
        workflow="charge",
        input={"order": 1, "amount": 5},
    )
    assert "**kwargs" in message  # and says what to do


def test_a_missing_required_field_is_refused_naming_step_and_field(shop):
    message = refused(
        shop, InvalidStart, "step 'reserve'", "'order'", workflow="charge", input={"quantity": 2}
    )
    assert "add it to the input" in message
    refused(shop, InvalidStart, "'order'", workflow="charge", input=None)


def test_a_compensation_gets_the_same_input_and_is_checked_too(durable):
    wf = durable.workflow("book")

    @wf.step(compensate=lambda trip: None)
    def reserve(trip, seat=None):
        pass

    refused(
        durable,
        InvalidStart,
        "compensation",
        "of step 'reserve'",
        "'seat'",
        workflow="book",
        input={"trip": 1, "seat": "4A"},
    )
    durable.start("book", {"trip": 1})


def test_parallel_branches_get_the_input_and_are_checked_at_start(durable):
    wf = durable.workflow("fan")

    def north(region):
        return region

    def south(region, depth=0):
        return depth

    wf.parallel(north, south)
    refused(
        durable,
        InvalidStart,
        "parallel branch 'north'",
        "'depth'",
        workflow="fan",
        input={"region": "x", "depth": 2},
    )
    refused(durable, InvalidStart, "'region'", workflow="fan", input={})
    durable.start("fan", {"region": "x"})


def test_positional_only_parameters_are_refused_at_definition(durable):
    wf = durable.workflow("positional")
    with pytest.raises(InvalidDefinition, match="positional-only parameter 'order'"):
        wf.step(lambda order, /: order, name="first")
    with pytest.raises(InvalidDefinition, match="compensation"):
        wf.step(lambda order: order, name="second", compensate=lambda order, /: None)
    assert wf.steps == []
    wf.step(lambda limit=10, /, **fields: fields, name="third")  # with a default: never from the input
    durable.start("positional", {"limit": 3})


def test_a_keyed_start_with_a_bad_input_writes_no_key(shop):
    refused(shop, InvalidStart, "'amount'", workflow="charge", input={"order": 1, "amount": 5}, key="order:1")
    refused(shop, InvalidStart, "'order'", workflow="charge", input={}, key="order:1")
    refused(shop, InvalidStart, "NUL", workflow="charge", input={"order": "\x00"}, key="order:1")
    assert shop.list_keys() == []


def test_a_key_template_names_the_step_that_needs_the_missing_field(durable):
    ship = durable.workflow("ship", key="ship:{order}")
    ship.step(lambda order: order, name="send")
    message = refused(durable, InvalidStart, "step 'send'", "'order'", workflow="ship", input={})
    assert "template" not in message


def test_every_duplicate_policy_checks_the_input_before_it_reaches_the_holder(shop):
    holder = shop.start("charge", {"order": 1}, key="order:1")
    for policy in ("use_existing", "run_again", "cancel_existing", "error", SendEvent("more")):
        refused(
            shop,
            InvalidStart,
            "'coupon'",
            workflow="charge",
            input={"order": 1, "coupon": "X"},
            key="order:1",
            on_duplicate=policy,
        )
    run = shop.get_run(holder)
    assert run.status == "pending" and run.input == {"order": 1}


def test_a_start_in_the_callers_transaction_is_checked_first(shop):
    with shop.db.engine.begin() as conn, pytest.raises(InvalidStart, match="'coupon'"):
        shop.start("charge", {"order": 1, "coupon": "X"}, connection=conn)
    assert counts(shop)["durable_runs"] == 0


def test_a_schedule_is_checked_when_it_is_defined(shop):
    with pytest.raises(InvalidStart, match="'coupon'"):
        shop.beat_entry("charge", "*/5 * * * *", key="order:1", input={"order": 1, "coupon": "X"})
    with pytest.raises(InvalidStart, match="NUL"):
        shop.beat_entry("anything", "*/5 * * * *", input={"tag": "a\x00b"})
    entry = shop.beat_entry("charge", "*/5 * * * *", key="order:1", input={"order": 1})
    assert entry["kwargs"]["input"] == {"order": 1}


def test_a_fire_whose_input_no_longer_fits_is_an_error_outcome_and_starts_nothing(shop):
    before = counts(shop)
    result = start_fire(
        shop.runtime, "charge", "order:1", {"order": 1, "coupon": "X"}, None
    )  # defined before a deploy
    assert result["outcome"] == "error" and result["run_id"] is None
    assert "InvalidStart" in result["error"] and "'coupon'" in result["error"]
    assert counts(shop) == before


def test_retry_and_rerun_refuse_a_run_whose_input_no_longer_fits(make_durable):
    old = make_durable("old")
    old.workflow("label").step(lambda order: order, name="print")
    failed, cancelled = old.start("label", {"order": 1}), old.start("label", {"order": 2})
    old.cancel(cancelled)
    with old.db.engine.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == failed).values(status="failed"))
    new = make_durable("new")  # a deploy: the step now needs a field the old runs lack
    new.workflow("label").step(lambda order, size: order, name="print")
    refused(new, InvalidStart, "step 'print'", "'size'", start=new.rerun, run_id=cancelled)
    refused(new, InvalidStart, "step 'print'", "'size'", start=new.retry, run_id=failed)
    assert new.get_run(failed).status == "failed"


def test_a_child_with_a_bad_input_fails_the_parent_step_and_is_never_started(shop):
    parent = shop.workflow("checkout")

    @parent.step
    def bill(order):
        return current_run().call_workflow("charge", {"order": order, "coupon": "X"})

    with worker(shop):
        run = wait_for(shop, shop.start(parent, {"order": 7}))
    assert run.status == "failed"
    assert run.error["type"] == "InvalidStart" and "'coupon'" in run.error["message"]
    assert shop.list_children(run.id) == []


# -- item 3: values both backends can store, with the documented errors -------------------------


@pytest.mark.parametrize(
    ("key", "words"),
    [("order:\x001", ("NUL",)), ("order:\udc80", ("surrogate",))],
)
def test_a_key_postgres_cannot_store_is_invalid_key(shop, key, words):
    refused(shop, InvalidKey, *words, workflow="charge", input={"order": 1}, key=key)
    derived = shop.workflow("derived", key=lambda data: key)  # a key callable's result is checked too
    derived.step(lambda order: order, name="only")
    refused(shop, InvalidKey, *words, workflow="derived", input={"order": 1})
    assert shop.list_keys() == []


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"order": "a\x00b"}, ("input['order']", "NUL")),
        (
            {"order": {"lines": [{"sku": "ok"}, {"sku": "x\x00"}]}},
            ("input['order']['lines'][1]['sku']", "NUL"),
        ),
        ({"order": {"bad\x00name": 1}}, ("field name", "NUL")),
        ({"order": "\ud800"}, ("input['order']", "surrogate")),
        ({"order": ["fine", {"note": "x\udfff"}]}, ("input['order'][1]['note']", "surrogate")),
        ({"order": float("nan")}, ("input['order'] is nan", "JSON cannot hold")),
        (
            {"order": {"lines": [1.5, float("inf")]}},
            ("input['order']['lines'][1] is inf", "JSON cannot hold"),
        ),
        ({"order": {"total": -float("inf")}}, ("input['order']['total'] is -inf",)),
        ({"order": {1, 2}}, ("JSON",)),
    ],
)
def test_a_value_that_cannot_be_stored_is_invalid_start(shop, value, words):
    refused(shop, InvalidStart, *words, workflow="charge", input=value)
    refused(shop, InvalidStart, *words, workflow="charge", input=value, key="order:1")


def test_deep_nesting_is_refused_without_recursion(shop):
    message = refused(
        shop,
        InvalidStart,
        f"{MAX_INPUT_DEPTH} levels",
        workflow="anything",
        input={"tag": "t", **nested(10_000)},
    )
    assert len(message) < 400
    loop: list[Any] = []
    loop.append(loop)
    refused(shop, InvalidStart, "refers to itself", workflow="anything", input={"tag": "t", "loop": loop})
    refused(shop, InvalidStart, workflow="anything", input={"tag": "t", **nested(MAX_INPUT_DEPTH + 1)})
    run_id = shop.start("anything", {"tag": "t", **nested(MAX_INPUT_DEPTH)})  # the limit itself is fine
    assert shop.get_run(run_id).input["n"] == nested(MAX_INPUT_DEPTH)["n"]


def test_text_both_backends_store_comes_back_the_same(shop):
    value = {"tag": "t", "text": "naïve 😀 \u2028 \\x00 \ufeff", "keys": {"ключ": ["\t", "\u0001"]}}
    run_id = shop.start("anything", value, key="ключ 😀")
    assert shop.get_run(run_id).input == value
    assert shop.get_run(run_id).key == "ключ 😀"


def test_the_default_limit_refuses_a_larger_input_naming_its_size(shop):
    message = refused(
        shop,
        InvalidStart,
        "1,000,011 bytes",
        "max_input_bytes (1,000,000)",
        workflow="anything",
        input={"tag": "x" * 1_000_000},
    )
    assert "elsewhere" in message
    shop.start("anything", {"tag": "x" * 999_989})  # {"tag": "..."}: exactly 1,000,000 bytes of JSON


def test_max_input_bytes_counts_utf8_bytes_of_the_json(make_durable):
    durable = make_durable(max_input_bytes=100)
    durable.workflow("note").step(lambda text: text, name="keep")
    durable.start("note", {"text": "x" * 88})  # {"text": "..."} is 12 bytes more: 100
    refused(
        durable, InvalidStart, "101 bytes", "max_input_bytes (100)", workflow="note", input={"text": "x" * 89}
    )
    refused(durable, InvalidStart, "102 bytes", workflow="note", input={"text": "é" * 45})  # 2 bytes each


def test_max_input_bytes_comes_from_app_conf_and_is_checked(make_durable, tmp_path):
    assert make_durable().settings.max_input_bytes == 1_000_000
    app = Celery("conf", broker="memory://")
    app.conf.durable_max_input_bytes = 50
    durable = Durable(app, f"sqlite:///{tmp_path}/conf.sqlite3", upkeep=False)
    assert durable.settings.max_input_bytes == 50
    for bad in (0, -1, 1.5, True, "1MB"):
        with pytest.raises(InvalidDefinition, match="max_input_bytes"):
            make_durable(max_input_bytes=bad)
