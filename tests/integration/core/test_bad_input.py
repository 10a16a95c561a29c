"""Bad input gets a clear durable_celery error and writes nothing."""

from __future__ import annotations

import pytest

from durable_celery import (
    DurableError,
    InvalidArgument,
    InvalidKey,
    InvalidStart,
    NotFinished,
    RunNotFound,
    UnknownWorkflow,
)
from durable_celery.store.schema import activity, keys, runs
from tests.integration.helpers import activity_log, count_rows, run_dict

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def shop(durable):
    wf = durable.workflow("charge")

    @wf.step
    def pay(amount):
        return amount

    return durable


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        (("no_such_workflow", {"amount": 1}), {}, UnknownWorkflow),
        ((42, {}), {}, UnknownWorkflow),
        (("charge", {"amount": object()}), {}, InvalidStart),
        (("charge", [1, 2]), {}, InvalidStart),
        (("charge", {"amount": 1}), {"key": ""}, InvalidKey),
        (("charge", {"amount": 1}), {"key": "k" * 256}, InvalidKey),
        (("charge", {"amount": 1}), {"key": 7}, InvalidKey),
        (("charge", {"amount": 1}), {"on_duplicate": "whatever"}, DurableError),
        (("charge", {"amount": 1}), {"connection": "not a connection"}, InvalidArgument),
    ],
)
def test_bad_start_raises_and_writes_nothing(shop, args, kwargs, error):
    with pytest.raises(error):
        shop.start(*args, **kwargs)
    assert shop.list_runs() == []


def test_empty_workflow_cannot_start(durable):
    durable.workflow("empty")
    with pytest.raises(UnknownWorkflow):
        durable.start("empty")
    assert durable.list_runs() == []


@pytest.mark.parametrize("run_id", ["00000000-0000-0000-0000-000000000000", "nope", 12, None])
def test_unknown_run_id_is_run_not_found(shop, run_id):
    for call in (shop.get_run, shop.cancel, shop.list_steps):
        with pytest.raises(RunNotFound):
            call(run_id)
    assert shop.list_runs() == []


def test_bad_list_arguments(shop):
    with pytest.raises(InvalidArgument):
        shop.list_runs(status="done")
    with pytest.raises(InvalidArgument):
        shop.list_runs(limit=0)


def test_bad_control_calls_raise_and_change_nothing(shop):
    run_id = shop.start("charge", {"amount": 1}, key="k")
    with pytest.raises(InvalidArgument):
        shop.send_event(run_id, "", {"x": 1})
    with pytest.raises(InvalidArgument):
        shop.send_event(run_id, "paid", {"x": object()})
    for call in (shop.retry, shop.rerun, shop.release_key):
        with pytest.raises(RunNotFound):
            call("no-such-run")
    with pytest.raises(NotFinished):
        shop.retry(run_id)
    with pytest.raises(InvalidArgument):
        shop.activity(limit=0)
    with pytest.raises(InvalidArgument):
        shop.list_keys(limit=-1)
    assert [r.id for r in shop.list_runs()] == [run_id]
    assert shop.get_run(run_id).status == "pending" and shop.get_run(run_id).holds_key
    assert shop.activity() == []


@pytest.mark.timeout(120)
def test_run_again_per_call_is_refused_under_reuse_never_and_writes_nothing(durable):
    """Guards issue 12: ``on_duplicate='run_again'`` given per call (to ``durable.start``, to
    ``wf.start``, by the workflow's name) is refused under ``reuse='never'``, before anything is
    written, with InvalidStart (a start argument; in a definition it is InvalidDefinition);
    other policies per call still work."""
    wf = durable.workflow("send_invoice", reuse="never", on_duplicate="error")

    @wf.step
    def send(id):
        pass

    with pytest.raises(InvalidStart, match="run_again.*reuse='never'"):
        durable.start(wf, {"id": "INV-1"}, key="invoice:INV-1", on_duplicate="run_again")
    assert (count_rows(durable, runs), count_rows(durable, keys), count_rows(durable, activity)) == (0, 0, 0)

    holder = durable.start(wf, {"id": "INV-1"}, key="invoice:INV-1")
    before, log_before = run_dict(durable, holder), activity_log(durable)
    for call in (
        lambda: durable.start(wf, {"id": "INV-1"}, key="invoice:INV-1", on_duplicate="run_again"),
        lambda: wf.start({"id": "INV-1"}, key="invoice:INV-1", on_duplicate="run_again"),
        lambda: durable.start("send_invoice", {"id": "INV-1"}, key="invoice:INV-1", on_duplicate="run_again"),
    ):
        with pytest.raises(InvalidStart, match="send_invoice"):
            call()
    assert (count_rows(durable, runs), count_rows(durable, keys)) == (1, 1)
    assert run_dict(durable, holder) == before
    assert activity_log(durable) == log_before
    # Other policies still work per call under reuse="never".
    assert durable.start(wf, {"id": "INV-1"}, key="invoice:INV-1", on_duplicate="use_existing") == holder
