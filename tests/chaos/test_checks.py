"""The chaos checks catch what they are there for: made-up ledgers and step rows (no servers)."""

from __future__ import annotations

import pytest

from tests.chaos.checks import (
    Execution,
    Report,
    Snapshot,
    check_activity,
    check_executions,
    check_runs,
    check_sampler,
    check_worked_after,
)
from tests.chaos.faults import Fault, FaultLog
from tests.chaos.load import KeySampler, Start

pytestmark = pytest.mark.chaos

RUN = "r1"


def _snapshot(execs: list[Execution], rows: list[dict[str, object]], activity=()) -> Snapshot:
    run = {"workflow": "chain", "status": "completed", "key": None, "error": None, "tag": "t"}
    return Snapshot({RUN: run}, {RUN: execs}, {RUN: rows}, list(activity))


def _exec(
    attempt: int,
    fence: int,
    pid: int,
    at: float,
    done: float | None = None,
    thread: int = 0,
    worker: str = "a",
) -> Execution:
    """An execution begun at ``at``, done at ``done`` (None: never, e.g. killed)."""
    return Execution(
        RUN, 0, attempt, fence, pid, worker, at, ended=done is not None, done=done, thread=thread
    )


def _row(
    attempt: int, pid: int, status: str = "completed", error: str | None = None, at: float = 30.0
) -> dict[str, object]:
    return {"step": 0, "attempt": attempt, "status": status, "pid": pid, "error": error, "at": at}


def _problems(snap: Snapshot, log: FaultLog) -> Report:
    report = Report("t")
    check_executions(snap, log, report)
    check_activity(snap, log, report)
    return report


def test_a_step_run_twice_with_no_fault_is_unexplained():
    snap = _snapshot([_exec(1, 1, 100, 10.0), _exec(1, 3, 200, 20.0)], [_row(1, 200)])
    report = _problems(snap, FaultLog())
    assert report.unexplained == 1 and "no fault hit that process" in report.problems[0]


def test_a_step_run_again_after_its_node_was_killed_is_explained_and_uses_no_attempt():
    log = FaultLog()
    log.add(Fault("kill_node", 15.0, 15.0, "a", (100, 101)))
    snap = _snapshot([_exec(1, 1, 100, 10.0), _exec(1, 3, 200, 20.0)], [_row(1, 200)])
    report = _problems(snap, log)
    assert (report.explained, report.unexplained, report.problems) == (1, 0, [])


def test_an_execution_begun_after_the_kill_is_not_explained_by_it():
    log = FaultLog()
    log.add(Fault("kill_node", 15.0, 15.0, "a", (100,)))
    snap = _snapshot([_exec(1, 1, 100, 16.0), _exec(1, 3, 200, 20.0)], [_row(1, 200)])
    assert _problems(snap, log).unexplained == 1


def test_a_result_recorded_by_a_fenced_process_is_found():
    log = FaultLog()
    log.add(Fault("stop", 12.0, 18.0, "a", (100,), {"held": {RUN: 1}}))
    snap = _snapshot([_exec(1, 1, 100, 10.0), _exec(1, 3, 200, 14.0)], [_row(1, 100)])
    report = _problems(snap, log)
    assert any("recorded by fenced process 100" in p for p in report.problems)


def test_a_stopped_step_that_wrote_its_ledger_row_after_sigcont_is_known_by_its_fence():
    log = FaultLog()
    log.add(Fault("stop", 12.0, 18.0, "a", (100,), {"held": {RUN: 1}}))
    snap = _snapshot([_exec(1, 1, 100, 18.5), _exec(1, 3, 200, 14.0)], [_row(1, 200)])
    assert _problems(snap, log).problems == []


def test_a_killed_pool_process_must_use_an_attempt():
    log = FaultLog()
    log.add(Fault("kill_child", 15.0, 15.0, "a", (100,)))
    no_attempt_used = _snapshot([_exec(1, 1, 100, 10.0), _exec(1, 2, 200, 20.0)], [_row(1, 200)])
    assert any("no attempt was used" in p for p in _problems(no_attempt_used, log).problems)
    used = _snapshot(
        [_exec(1, 1, 100, 10.0), _exec(2, 2, 200, 20.0)],
        [_row(1, 100, "failed", "WorkerLost", at=15.2), _row(2, 200)],
    )
    assert _problems(used, log).problems == []


def test_an_attempt_charged_to_a_lost_node_is_found():
    log = FaultLog()
    log.add(Fault("kill_node", 15.0, 15.0, "a", (100,)))
    snap = _snapshot(
        [_exec(1, 1, 100, 10.0), _exec(2, 3, 200, 20.0)],
        [_row(1, 100, "failed", "WorkerLost"), _row(2, 200)],
    )
    problems = _problems(snap, log).problems
    assert any("WorkerLost charged to process 100" in p for p in problems)
    assert any("a lost node (kill_node) used an attempt" in p for p in problems)


def test_an_attempt_used_without_a_recorded_failure_is_found():
    snap = _snapshot([_exec(2, 2, 200, 20.0)], [_row(2, 200)])
    assert any("were used without a failure" in p for p in _problems(snap, FaultLog()).problems)


def test_a_stale_take_back_of_a_healthy_worker_is_found():
    activity = [{"kind": "stale_recovered", "run_id": RUN, "details": {"locked_by": "h:100:7"}, "at": 20.0}]
    snap = _snapshot([_exec(1, 1, 200, 21.0)], [_row(1, 200)], activity)
    assert any("stale_recovered names process 100" in p for p in _problems(snap, FaultLog()).problems)


def test_the_key_sampler_reports_two_holders():
    sampler = KeySampler("postgresql://unused")
    sampler.samples = 3
    sampler.violations.append((0.0, "two unfinished holders", "keyed", "item:1", ["x", "y"]))
    report = Report("t")
    check_sampler(sampler, report)
    (problem,) = report.problems
    assert "two unfinished holders: keyed item:1 ['x', 'y']" in problem


def test_a_killed_pool_process_whose_lock_was_already_swept_uses_no_attempt():
    log = FaultLog()
    log.add(Fault("kill_child", 15.0, 15.0, "a", (100,)))
    activity = [{"kind": "stale_recovered", "run_id": RUN, "details": {"locked_by": "h:100:7"}, "at": 14.8}]
    snap = _snapshot([_exec(1, 1, 100, 10.0), _exec(1, 3, 200, 20.0)], [_row(1, 200)], activity)
    report = _problems(snap, log)
    assert report.problems == []
    assert report.counts["killed pool process swept before its worker saw it"] == 1


def test_an_execution_done_before_a_later_fault_is_not_explained_by_it():
    log = FaultLog()
    log.add(Fault("kill_node", 15.0, 15.0, "a", (100,)))
    snap = _snapshot([_exec(1, 1, 100, 10.0, done=11.0), _exec(1, 3, 200, 20.0, done=20.5)], [_row(1, 200)])
    report = _problems(snap, log)
    assert (
        report.unexplained == 1 and "no fault hit that process while it was in progress" in report.problems[0]
    )


def test_a_fault_on_a_threads_worker_explains_only_what_was_in_progress_in_that_process():
    """A stop or kill hits every thread of the process: a step in progress in another thread is
    explained, a step done before it is not."""
    log = FaultLog()
    log.add(Fault("stop", 15.0, 22.0, "b", (100,), {"held": {}}))
    in_progress = _snapshot([_exec(1, 1, 100, 14.0, thread=7), _exec(1, 3, 200, 20.0)], [_row(1, 200)])
    assert _problems(in_progress, log).explained == 1
    early = _snapshot([_exec(1, 1, 100, 12.0, done=13.0, thread=8), _exec(1, 3, 200, 20.0)], [_row(1, 200)])
    assert _problems(early, log).unexplained == 1


def test_a_lost_node_keeps_the_attempt_of_the_next_execution():
    log = FaultLog()
    log.add(Fault("kill_parent", 15.0, 15.5, "a", (100, 101)))
    kept = _snapshot([_exec(1, 1, 101, 10.0), _exec(1, 3, 200, 20.0)], [_row(1, 200)])
    assert _problems(kept, log).problems == []
    moved_on = _snapshot(
        [_exec(1, 1, 101, 10.0), _exec(2, 3, 200, 20.0)], [_row(1, 300, "failed", "Boom"), _row(2, 200)]
    )
    problems = _problems(moved_on, log).problems
    assert any(
        "lost to kill_parent (0 attempt used), but the next execution ran attempt 2" in p for p in problems
    )


def test_a_sweep_long_after_the_kill_does_not_excuse_an_unused_attempt():
    """A killed pool process whose loss its worker never recorded is swept once its lock goes stale;
    a sweep later than the worker's time to see the death does not excuse it."""
    log = FaultLog()
    log.add(Fault("kill_child", 15.0, 15.0, "a", (100,)))
    activity = [{"kind": "stale_recovered", "run_id": RUN, "details": {"locked_by": "h:100:7"}, "at": 20.5}]
    snap = _snapshot([_exec(1, 1, 100, 10.0), _exec(1, 3, 200, 21.0)], [_row(1, 200)], activity)
    assert any("no attempt was used" in p for p in _problems(snap, log).problems)


def test_a_sweep_before_the_worker_saw_the_kill_excuses_the_unused_attempt():
    log = FaultLog()
    log.add(Fault("kill_child", 15.0, 15.0, "a", (100,)))
    activity = [{"kind": "stale_recovered", "run_id": RUN, "details": {"locked_by": "h:100:7"}, "at": 19.2}]
    snap = _snapshot([_exec(1, 1, 100, 10.0), _exec(1, 3, 200, 20.0)], [_row(1, 200)], activity)
    report = _problems(snap, log)
    assert report.problems == [] and report.counts["killed pool process swept before its worker saw it"] == 1


def test_a_killed_pool_process_whose_worker_went_much_later_must_still_use_an_attempt():
    log = FaultLog()
    log.add(Fault("kill_child", 15.0, 15.0, "a", (100,)))
    log.add(Fault("kill_node", 25.0, 25.0, "a", (90, 101)))
    snap = _snapshot([_exec(1, 1, 100, 10.0), _exec(1, 3, 200, 26.0)], [_row(1, 200)])
    assert any("no attempt was used" in p for p in _problems(snap, log).problems)
    log.faults[1].t0 = log.faults[1].t1 = 15.5  # its worker went before it could record the loss
    assert _problems(snap, log).problems == []


def test_a_worker_lost_attempt_recorded_long_after_the_kill_is_found():
    log = FaultLog()
    log.add(Fault("kill_child", 15.0, 15.0, "a", (100,)))
    snap = _snapshot(
        [_exec(1, 1, 100, 10.0), _exec(2, 2, 200, 40.0)],
        [_row(1, 100, "failed", "WorkerLost", at=35.0), _row(2, 200)],
    )
    assert any("recorded 20.0s after the kill" in p for p in _problems(snap, log).problems)


def test_an_entry_long_after_a_fault_is_not_caused_by_it():
    log = FaultLog()
    log.add(Fault("stop", 15.0, 22.0, "a", (100,), {"held": {RUN: 1}}))
    fenced = [{"kind": "worker_fenced", "run_id": RUN, "details": {"node": "h:100"}, "at": 23.0}]
    snap = _snapshot([_exec(1, 1, 100, 14.0), _exec(1, 3, 200, 20.0)], [_row(1, 200)], fenced)
    assert _problems(snap, log).problems == []
    fenced[0]["at"] = 60.0
    assert any("worker_fenced names process 100" in p for p in _problems(snap, log).problems)


def test_every_worker_must_work_after_an_outage():
    snap = _snapshot([_exec(1, 1, 100, 10.0, worker="a"), _exec(1, 2, 200, 20.0, worker="b")], [])
    report = Report("t")
    check_worked_after(report, snap, ["a", "b"], 15.0, "the outage")
    assert report.problems == ["worker a began no step after the outage ended: did it reconnect?"]


def test_a_returned_id_neither_present_nor_accounted_for_is_lost():
    started = [
        Start("chain", "t", run_id=RUN),
        Start("chain", "u", run_id="gone"),
        Start("chain", "v", run_id="p"),
    ]
    snap = _snapshot([], [])
    report = Report("t")
    check_runs(snap, started, report, accounted={"p"})
    assert report.lost == 1 and report.problems == ["start returned run gone, which does not exist"]
