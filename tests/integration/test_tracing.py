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
        from durable_celery import Durable, tracing
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
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
