"""The chaos checks catch what they are there for: made-up ledgers and step rows (no servers)."""

from __future__ import annotations

import pytest

from tests.chaos.checks import Execution, Report, Snapshot, check_activity, check_executions, check_sampler
from tests.chaos.faults import Fault, FaultLog
from tests.chaos.load import KeySampler

pytestmark = pytest.mark.chaos

RUN = "r1"


def _snapshot(execs: list[Execution], rows: list[dict[str, object]], activity=()) -> Snapshot:
    run = {"workflow": "chain", "status": "completed", "key": None, "error": None, "tag": "t"}
    return Snapshot({RUN: run}, {RUN: execs}, {RUN: rows}, list(activity))


def _exec(attempt: int, fence: int, pid: int, at: float) -> Execution:
    return Execution(RUN, 0, attempt, fence, pid, "a", at, ended=True)


def _row(attempt: int, pid: int, status: str = "completed", error: str | None = None) -> dict[str, object]:
    return {"step": 0, "attempt": attempt, "status": status, "pid": pid, "error": error, "at": 0.0}


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
        [_row(1, 100, "failed", "WorkerLost"), _row(2, 200)],
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
    assert report.counts["killed after its lock was swept (starved)"] == 1
