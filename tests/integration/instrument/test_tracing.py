"""Tracing: every step attempt is a span, and a run is one trace across retries, sleeps and workers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from sqlalchemy import update

from durable_celery import current_run
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_attempts_sleeps_and_workers_share_the_run_trace(make_durable, exported):
    provider, exporter = exported
    durable = make_durable(tracer_provider=provider)
    wf = durable.workflow("ship")

    @wf.step
    def pack(order):
        current_run().sleep(0.3)

    @wf.step(retry=2)
    def send(order):
        if current_run().attempt == 1:
            raise ConnectionError("carrier down")
        return "sent"

    caller = provider.get_tracer("app")
    with caller.start_as_current_span("checkout") as checkout:
        run_id = durable.start(wf, {"order": 1}, key="order:1")
    with worker(durable):  # pack parks on its sleep; this worker then stops
        wait_for(durable, run_id, statuses=("waiting",))
    with worker(durable):  # another worker finishes the run
        assert wait_for(durable, run_id).status == "completed"

    spans = exporter.get_finished_spans()
    start = next(s for s in spans if s.name == "durable.start ship")
    steps = [s for s in spans if s.name.startswith("durable.step")]
    assert [(s.name, s.attributes["durable.attempt"], s.attributes["durable.outcome"]) for s in steps] == [
        ("durable.step ship.pack", 1, "parked"),
        ("durable.step ship.pack", 1, "completed"),
        ("durable.step ship.send", 1, "failed"),
        ("durable.step ship.send", 2, "completed"),
    ]
    trace_id = checkout.get_span_context().trace_id
    assert {s.context.trace_id for s in [start, *steps]} == {trace_id}  # the caller's trace, too
    assert start.parent.span_id == checkout.get_span_context().span_id
    assert {s.parent.span_id for s in steps} == {start.context.span_id}
    assert len({s.context.span_id for s in steps}) == 4
    failed = steps[2]
    assert failed.status.status_code is StatusCode.ERROR and "carrier down" in failed.status.description
    assert failed.events[0].name == "exception"
    assert steps[3].status.status_code is StatusCode.UNSET
    assert dict(steps[3].attributes) == {
        "durable.workflow": "ship",
        "durable.run_id": run_id,
        "durable.key": "order:1",
        "durable.step": "send",
        "durable.attempt": 2,
        "durable.outcome": "completed",
    }
    stored = durable.get_run(run_id)
    assert stored.status == "completed"
    with durable.db.engine.connect() as conn:
        from durable_celery.store.observe_rows import trace_parent_of

        trace_parent = trace_parent_of(conn, run_id)
    assert trace_parent.startswith(f"00-{trace_id:032x}-{start.context.span_id:016x}-")


def test_a_run_started_untraced_gets_its_trace_at_its_first_step(make_durable, exported):
    provider, exporter = exported
    durable = make_durable(tracer_provider=provider)
    wf = durable.workflow("legacy")

    @wf.step(retry=2)
    def only():
        if current_run().attempt == 1:
            raise RuntimeError("first try fails")

    run_id = durable.start(wf)
    with durable.db.begin() as conn:  # as if started by a process without tracing
        conn.execute(update(runs).where(runs.c.id == run_id).values(trace_parent=None))
    exporter.clear()
    with worker(durable):
        assert wait_for(durable, run_id).status == "completed"
    first, second = exporter.get_finished_spans()
    assert first.parent is None  # the first attempt starts the run's trace
    assert second.context.trace_id == first.context.trace_id
    assert second.parent.span_id == first.context.span_id


def test_no_trace_is_written_without_a_tracer_provider(make_durable):
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)  # the API's no-op default
    durable = make_durable()
    wf = durable.workflow("plain")

    @wf.step
    def only():
        return 1

    run_id = durable.start(wf)
    with worker(durable):
        assert wait_for(durable, run_id).status == "completed"
    with durable.db.engine.connect() as conn:
        from durable_celery.store.observe_rows import trace_parent_of

        assert trace_parent_of(conn, run_id) is None


def test_without_a_tracer_provider_a_run_joins_the_callers_propagated_trace(make_durable):
    """No SDK: no span is made, but a caller's context (e.g. from a request's traceparent
    header) is the run's trace, and each step's logs carry its trace id."""
    from opentelemetry import context as otel_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    durable = make_durable()
    wf = durable.workflow("joined")

    @wf.step
    def only():
        import logging

        logging.getLogger("joined").warning("inside")
        return 1

    header = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    token = otel_context.attach(TraceContextTextMapPropagator().extract({"traceparent": header}))
    try:
        run_id = durable.start(wf)
    finally:
        otel_context.detach(token)
    untraced = durable.start(wf)
    with worker(durable):
        assert wait_for(durable, run_id).status == "completed"
        assert wait_for(durable, untraced).status == "completed"
    with durable.db.engine.connect() as conn:
        from durable_celery.store.observe_rows import trace_parent_of

        assert trace_parent_of(conn, run_id) == header
        assert trace_parent_of(conn, untraced) is None
    step = durable.list_steps(run_id)[0]
    assert [(e["trace_id"], e["body"]) for e in step.logs] == [("0af7651916cd43dd8448eb211c80319c", "inside")]
    assert durable.list_steps(untraced)[0].logs[0]["trace_id"] is None


def test_without_opentelemetry_installed_everything_still_imports_and_runs(tmp_path):
    script = textwrap.dedent(
        """
        import sys

        class NoOtel:
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ImportError("no opentelemetry here")
                return None

        sys.meta_path.insert(0, NoOtel())
        from celery import Celery
        from durable_celery import Durable
        from durable_celery.instrument import tracing
        from durable_celery.testing import wait_for, worker

        assert not tracing.available()
        app = Celery("nootel", broker="memory://")
        durable = Durable(app, "sqlite:///" + sys.argv[1] + "/d.sqlite3", poll_interval=0.1)
        durable.migrate()
        wf = durable.workflow("w")

        @wf.step
        def only():
            import logging
            logging.getLogger("x").warning("hello")
            return 2

        run_id = durable.start(wf)
        with worker(durable):
            assert wait_for(durable, run_id).output == 2
        (step,) = durable.list_steps(run_id)
        assert step.logs[0]["trace_id"] is None and step.logs[0]["body"] == "hello"
        print("ok")
        """
    )
    # The repository's root on the path (not tests/, whose django folder would shadow Django), and
    # a plain Celery app: no Django settings another test of this process may have set.
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_children_and_branches_are_in_the_parent_trace_under_the_step_that_started_them(
    make_durable, exported
):
    provider, exporter = exported
    durable = make_durable(tracer_provider=provider)
    invoice = durable.workflow("invoice")

    @invoice.step
    def draft(order):
        return None

    @invoice.step
    def issue(order):
        return f"INV-{order}"

    wf = durable.workflow("order")

    @wf.step
    def bill(order):  # parks for the child, then runs again from the top and finds it
        current_run().context["invoice"] = current_run().call_workflow(invoice, {"order": order})

    def charge(order):
        return "charged"

    def pack(order):
        return "packed"

    wf.parallel(charge, pack)

    run_id = durable.start(wf, {"order": 3})
    with worker(durable):
        run = wait_for(durable, run_id)
    assert run.status == "completed" and run.context["invoice"] == "INV-3"

    spans = exporter.get_finished_spans()
    (start,) = [s for s in spans if s.name == "durable.start order"]
    trace_id = start.context.trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}  # one trace, children and all

    def steps_of(some_run_id):
        return [
            s
            for s in spans
            if s.name.startswith("durable.step") and s.attributes["durable.run_id"] == some_run_id
        ]

    parent_steps = steps_of(run_id)
    bills = [s for s in parent_steps if s.name == "durable.step order.bill"]
    fan_outs = [s for s in parent_steps if s.name == "durable.step order.parallel_charge_pack"]
    assert len(bills) + len(fan_outs) == len(parent_steps)
    for passes in (bills, fan_outs):
        # The first pass starts the children and parks; every later pass is a replay that
        # finds them (and parks again while one is unfinished, e.g. the other branch).
        outcomes = [s.attributes["durable.outcome"] for s in passes]
        assert outcomes[0] == "parked" and outcomes[-1] == "completed" and len(outcomes) >= 2
        assert set(outcomes[1:-1]) <= {"parked"}
    # One start span per child: a replay that finds its children starts (and stamps) nothing.
    assert sorted(s.name for s in spans if s.name.startswith("durable.start")) == [
        "durable.start invoice",
        "durable.start order",
        "durable.start order.charge",
        "durable.start order.pack",
    ]
    starter = {"invoice": bills[0], "order.charge": fan_outs[0], "order.pack": fan_outs[0]}
    children = durable.list_children(run_id)
    assert sorted(c.workflow for c in children) == ["invoice", "order.charge", "order.pack"]
    for child in children:
        # The child's start span is a child of the parent's step attempt span (the pass that
        # started it, not the replay); the child's steps hang under that start span, as a
        # top-level run's steps hang under its durable.start span.
        (child_start,) = [
            s
            for s in spans
            if s.name.startswith("durable.start") and s.attributes["durable.run_id"] == child.id
        ]
        assert child_start.name == f"durable.start {child.workflow}"
        assert child_start.parent.span_id == starter[child.workflow].context.span_id
        child_steps = steps_of(child.id)
        assert len(child_steps) == (2 if child.workflow == "invoice" else 1)
        assert {s.parent.span_id for s in child_steps} == {child_start.context.span_id}
        with durable.db.engine.connect() as conn:
            from durable_celery.store.observe_rows import trace_parent_of

            stored = trace_parent_of(conn, child.id)
        assert stored.startswith(f"00-{trace_id:032x}-{child_start.context.span_id:016x}-")
