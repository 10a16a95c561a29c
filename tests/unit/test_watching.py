"""Log capture settings, severity numbers and traceparents: no servers needed."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from durable_celery import InvalidDefinition
from durable_celery.instrument.logs import LogCapture, severity_number
from durable_celery.instrument.tracing import context_of, traceparent_of


def test_log_capture_defaults_to_warning_and_above_with_all_metadata_on_the_console():
    default = LogCapture.from_setting(None)
    assert default == LogCapture.from_setting(True)
    assert [default.keeps(n) for n in (10, 20, 30, 40, 50)] == [False, False, True, True, True]
    assert default.metadata_filter is None and default.console
    assert not LogCapture.from_setting(False).keeps(logging.CRITICAL)
    everything = LogCapture.from_setting({"levels": "all", "console": False, "metadata_filter": ["a"]})
    assert everything.keeps(5) and not everything.console and everything.metadata_filter == {"a"}
    mixed = LogCapture.from_setting({"levels": ["info", logging.ERROR]})
    assert mixed.levels == {logging.INFO, logging.ERROR}


@pytest.mark.parametrize(
    "setting",
    [
        "WARNING",
        {"levels": "WARNING"},
        {"levels": ["LOUD"]},
        {"levels": [True]},
        {"metadata_filter": "account_id"},
        {"metadata_filter": [1]},
        {"console": "no"},
        {"colour": True},
    ],
)
def test_bad_log_capture_settings_are_refused(setting):
    with pytest.raises(InvalidDefinition):
        LogCapture.from_setting(setting)


def test_severity_numbers_are_opentelemetry_s():
    levels = (logging.NOTSET, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
    assert [severity_number(n) for n in levels] == [1, 5, 9, 13, 17, 21]
    assert severity_number(25) == 11 and severity_number(99) == 24


def test_a_traceparent_round_trips_through_the_run_row():
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("start") as span:
        stored = traceparent_of(span)
    assert stored is not None and stored.startswith("00-")
    with tracer.start_as_current_span("step", context=context_of(stored)) as child:
        assert child.get_span_context().trace_id == span.get_span_context().trace_id
        assert child.parent.span_id == span.get_span_context().span_id
    assert context_of(None) is None


def test_without_prometheus_client_metrics_say_which_extra_to_install(tmp_path):
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(
        """
        import sys

        class NoPrometheus:
            def find_spec(self, name, path=None, target=None):
                if name == "prometheus_client" or name.startswith("prometheus_client."):
                    raise ImportError("not installed")
                return None

        sys.meta_path.insert(0, NoPrometheus())
        from celery import Celery
        from durable_celery import Durable, NotConfigured

        durable = Durable(Celery("noprom", broker="memory://"), "sqlite:///" + sys.argv[1] + "/d.sqlite3")
        try:
            durable.metrics
        except NotConfigured as exc:
            print(exc)
        """
    )
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'durable-celery[metrics]'" in done.stdout


def test_a_step_tasks_summary_reads_like_its_dict_and_shows_as_its_repr():
    from celery.utils.saferepr import saferepr

    from durable_celery.worker.task_states import StepSummary

    items = {"run_id": "r-1", "step": "charge", "next": "ship"}
    summary = StepSummary(dict(items))
    assert summary == items and dict(summary) == items and summary["next"] == "ship"
    assert len(summary) == 3 and list(summary) == ["run_id", "step", "next"]
    # What Celery logs and sends in task-succeeded (Flower's "result"): the dict's own text.
    assert saferepr(summary, 1024) == saferepr(items, 1024) == repr(items)
