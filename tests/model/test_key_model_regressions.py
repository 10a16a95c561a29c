"""Sequences of the model suite replayed as plain tests, on PostgreSQL and SQLite: examples
hypothesis shrank when the harness and the library disagreed, and paths of the key guide that
random sequences reach rarely. Every ``h.*`` call is checked against the model as it returns
(its answer, every run and key, activity, signals, messages sent, ``stats.keys()``).

A failing example of test_key_model.py prints as such a script (``h.reset(...)``, ``h.start(...)``,
...): paste it here as a new test. One that shows a bug in the library is marked
``@pytest.mark.xfail(strict=True, reason="bug: ...")`` until the library is fixed.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.model, pytest.mark.timeout(120)]


def test_a_retried_run_that_fails_again_finishes_again(harness):
    # Shrunk (a harness bug: run_finished was expected once per run, not once per ending).
    h = harness
    h.reset("after_close", "off", "use_existing")
    h.start("a", 0, None)
    h.start("a", 0, None)
    h.start("a", 0, None)
    h.work(0, "fail", None)
    h.retry(0)
    h.work(0, "fail", None)


def test_run_again_behind_a_debounced_run_takes_the_key_and_is_debounced_in_turn(harness):
    h = harness
    h.reset("after_close", "period+timeout", "run_again")
    h.start("a", 0, None)  # run 0, due at 2.5
    h.work(0, "ok", None)  # dropped: still waiting out its period
    h.tick(3)
    h.work(0, "ok", None)  # claimed: later starts are ordinary duplicates
    h.start("a", 1, None)  # run 1 waits behind it (its timeout cap: 3 + 4 = 7)
    h.start("a", 2, None)  # ... with the newest input
    h.work(0, "ok", None)  # run 0 completes; run 1 takes the key, due now
    h.start("a", 0, None)  # folded into run 1, unclaimed: due at 5.5
    h.tick(2)
    h.start("a", 1, None)  # folded again: 7.5, capped at 7
    h.tick(1)
    h.work(1, "ok", None)  # dropped at 6
    h.tick(1)
    h.work(1, "ok", None)  # runs at 7
    h.work(1, "ok", None)


def test_cancel_from_inside_the_holders_step_hands_the_key_to_the_waiting_run(harness):
    h = harness
    h.reset("after_failure", "off", "run_again")
    h.start("a", 0, None)
    h.work(0, "ok", None)
    h.start("a", 1, None)  # run 1 waits behind the running holder
    h.work(0, "ok", ("cancel",))  # cancelled mid-step: its result is not recorded
    h.start("a", 2, None)  # run 1 holds the key, unclaimed: it takes the input itself
    h.work(1, "ok", None)
    h.work(1, "ok", None)
    h.start("a", 0, None)  # completed, kept by after_failure: KeyTaken
    h.start("a", 0, "use_existing")


def test_cancel_existing_from_inside_the_holders_step(harness):
    h = harness
    h.reset("after_close", "off", "use_existing")
    h.start("a", 0, None)
    h.work(0, "ok", ("start", 1, "cancel_existing"))
    h.work(1, "ok", ("start", 2, "run_again"))
    h.work(1, "ok", None)
    h.work(2, "ok", None)


def test_a_compensating_holder_keeps_its_key_until_released(harness):
    h = harness
    h.reset("never", "off", "cancel_existing")
    h.start("a", 0, None)
    h.work(0, "ok", None)
    h.work(0, "fail", ("send_event", 1, True))  # second fails: compensating
    h.start("a", 1, None)  # cancel_existing cannot cancel a compensating holder: KeyTaken
    h.cancel(0)  # False
    h.work(0, "fail", ("start", 2, "use_existing"))  # compensation_failed
    h.start("a", 1, "use_existing")
    h.rerun(0)  # KeyTaken: never keeps the key
    h.release_key(0)
    h.rerun(0)
    h.release_key(0)  # NoKey


def test_retry_takes_back_a_released_key_and_a_pruned_holder_frees_one(harness):
    h = harness
    h.reset("after_close", "off", "error")
    h.start("a", 0, None)
    h.work(0, "fail", None)
    h.start("a", 1, None)  # failed frees the key under after_close: a hand-off
    h.retry(0)  # KeyTaken: run 1 is still going
    h.work(1, "ok", None)
    h.work(1, "ok", None)
    h.release_key(1)
    h.retry(0)  # the key was free: retaken from None
    h.work(0, "ok", None)
    h.work(0, "ok", None)
    h.tick(1)
    h.prune()  # finished one tick ago: kept
    h.tick(1)
    h.prune()  # two: runs 0 and 1 go, and run 0's key with it
    h.retry(0)  # RunNotFound
    h.start("a", 2, None)  # a free key: no hand-off entry


def test_send_event_starts_are_kept_until_the_holder_waits(harness):
    h = harness
    h.reset("after_close", "off", "send_event")
    h.start("a", 0, None)
    h.work(0, "ok", None)
    h.start("a", 1, None)  # kept
    h.start("a", 2, None)  # kept: the newest is what the wait gets
    h.work(0, "wait", None)
    h.start("b", 0, None)
    h.work(1, "ok", None)
    h.work(1, "wait", None)  # parks
    h.send_event(1, "other", 1, False)  # not waited for: False, nothing kept
    h.work(1, "ok", None)  # dropped: parked
    h.start("b", 1, None)  # wakes it
    h.work(1, "wait", None)


def test_rerun_is_refused_by_a_debounced_holder_and_leaves_its_wait_alone(harness):
    h = harness
    h.reset("after_close", "period", "use_existing")
    h.start("a", 0, None)
    h.tick(3)
    h.work(0, "fail", None)
    h.start("a", 1, None)  # a hand-off; the new run waits out its period (due 5.5)
    h.rerun(0)  # KeyTaken, nothing folded
    h.tick(2)
    h.work(1, "ok", None)  # dropped at 5
    h.tick(1)
    h.work(1, "ok", None)


def test_run_again_on_a_never_workflow_is_refused_before_anything_is_written(harness):
    h = harness
    h.reset("never", "period", "use_existing")
    h.start("a", 0, "run_again")
    h.start("a", 0, None)
    h.start("a", 1, "run_again")
    h.start(None, 1, None)  # unkeyed: not debounced
    h.work(1, "ok", None)
