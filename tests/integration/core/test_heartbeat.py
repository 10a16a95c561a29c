"""The heartbeat thread: it stops a step past its timeout (the attempt fails naming the
timeout), ends when the process is idle, and the next step starts another.

Steps run through ``run_message``, as a worker runs a message, in the test's thread, on both
backends. Written against mutants of durable_celery/core/engine.py that the behaviour tests
let through."""

from __future__ import annotations

import threading
import time

import pytest

pytestmark = pytest.mark.timeout(60)


def test_a_step_past_its_timeout_fails_the_attempt_naming_the_timeout(durable):
    wf = durable.workflow("too_slow")

    @wf.step(timeout=0.2)
    def crawl():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # stopped by the heartbeat thread at its timeout
            time.sleep(0.01)

    run_id = durable.start(wf)
    assert durable.run_message("too_slow", 0, run_id) == "failed"
    (attempt,) = durable.list_steps(run_id)
    assert (attempt.error["type"], attempt.error["message"]) == (
        "StepTimeout",
        "step 'crawl' ran past its timeout of 0.2s",
    )


def test_the_heartbeat_thread_ends_when_idle_and_the_next_step_starts_another(durable, monkeypatch):
    """An idle process keeps no thread waking to heartbeat nothing; timeouts hold after a restart."""
    from durable_celery.core import heartbeat

    monkeypatch.setattr(heartbeat, "IDLE_EXIT", 0.2)
    wf = durable.workflow("beats_then_idles")

    @wf.step(timeout=0.3)
    def crawl(slow):
        deadline = time.monotonic() + (10 if slow else 0)
        while time.monotonic() < deadline:  # stopped by the heartbeat thread at its timeout
            time.sleep(0.01)
        return threading.current_thread().name

    beats = durable.engine.heartbeater
    assert durable.run_message("beats_then_idles", 0, durable.start(wf, {"slow": False})) == "completed"
    first = beats._thread
    assert first is not None
    first.join(timeout=10)  # nothing to watch: the thread ends by itself
    assert not first.is_alive() and beats._thread is None
    run_id = durable.start(wf, {"slow": True})
    assert durable.run_message("beats_then_idles", 0, run_id) == "failed"  # a new thread enforced it
    assert durable.list_steps(run_id)[0].error["type"] == "StepTimeout"
    assert beats._thread is not None and beats._thread is not first
