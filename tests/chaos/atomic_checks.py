"""What the atomic scenario must show afterwards (``atomic.py``), from the database, the chaos
ledger and the application's ledger.

- The application's ledger (``check_ledger``): exactly one ``atomic_ledger`` row for each
  completed run, none for a run that failed or was cancelled; each account's balance is the sum
  of its completed runs' amounts; the row that stayed is the one the recorded execution wrote
  (its attempt, fencing token and process). These are the *violations*: problems for
  ``ledger_atomic``, expected of ``ledger_plain``, whose duplicates are counted by cause (a run
  booked twice in one attempt was run again after a fault; in two attempts, after it raised).
- Runs: every start returned a run, which ended as its input says (completed, or failed when
  told to fail on every attempt; cancelled exactly when a cancel returned True); none is stuck.
- Executions of ``book`` (``check_executions``): each one durable did not record ran again and
  must be explained by a fault that hit its process while it was in progress, by a PostgreSQL
  outage while it was in progress (its transaction broke), or be the last of a cancelled run;
  the others are *unexplained*. Executions that ran again after their writes are counted:
  without one, the scenario proved nothing about atomicity, which is a problem too.
- Starts raised nothing but ``DatabaseUnavailable`` during the outage (``checks.check_starts``).
  (The scenario checks once that nothing is half-written: ``checks.check_consistency``.)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import psycopg

from tests.chaos.atomic_workflows import ATOMIC, BOOK, PLAIN
from tests.chaos.checks import (
    RERUN_FAULTS,
    SHOWN,
    UNFINISHED,
    Execution,
    Report,
    Snapshot,
    check_starts,
)
from tests.chaos.faults import FaultLog
from tests.chaos.load import Start

# What a run told to fail on every attempt fails with: its own error, or the database outage when
# that broke its last attempt (every attempt but the last raised Declined).
FAILED_WITH = ("Declined", "DatabaseUnavailable")
# A step that is not atomic writes on its own connection: the outage breaks that one as psycopg's
# own error (the server terminating it, or no server to connect to), raised by the step itself.
OWN_CONNECTION_BROKEN = ("AdminShutdown", "OperationalError", "InterfaceError")
# A PostgreSQL outage breaks the transaction of a step in progress: from a second before it
# (pg_ctl's stop takes a moment to reach every backend) to a second after it was back.
OUTAGE_REACH = 1.0


@dataclass
class LedgerSnapshot:
    """What the database holds about the scenario's runs."""

    runs: dict[str, dict[str, Any]]  # run id -> status, error, input
    rows: dict[str, list[dict[str, Any]]]  # run id -> its atomic_ledger rows
    balances: dict[int, int]  # account -> total
    steps: dict[str, list[dict[str, Any]]]  # run id -> its step rows of ``book``
    executions: dict[str, list[Execution]]  # run id -> its executions of ``book``, in claim order
    wrote: set[tuple[str, int, int, int, int]]  # (run, attempt, fence, pid, thread): past their writes
    activity: dict[str, int]  # kind -> entries (stale_recovered, worker_fenced)


def load_ledger(conn: psycopg.Connection[Any], workflow: str) -> LedgerSnapshot:
    """Runs of ``workflow``, the ledger and balances, the step rows and executions of ``book``."""
    runs = {}
    query = "SELECT id, status, error, input FROM durable_runs WHERE workflow = %s"
    for rid, status, error, data in conn.execute(query, (workflow,)):
        runs[rid] = {"status": status, "error": error or {}, "input": data, "workflow": workflow}
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    query = (
        "SELECT run_id, account, amount, attempt, fence, pid FROM atomic_ledger "
        "WHERE workflow = %s ORDER BY id"
    )
    for rid, *values in conn.execute(query, (workflow,)):
        rows[rid].append(dict(zip(("account", "amount", "attempt", "fence", "pid"), values, strict=True)))
    query = "SELECT account, total FROM atomic_balances WHERE workflow = %s"
    balances = dict(conn.execute(query, (workflow,)).fetchall())
    steps: dict[str, list[dict[str, Any]]] = defaultdict(list)
    query = (
        "SELECT run_id, attempt, status, worker, error->>'type' FROM durable_steps "
        "WHERE phase = 'step' AND step_index = %s AND run_id = ANY(%s)"
    )
    for rid, attempt, status, worker, error in conn.execute(query, (BOOK, list(runs))):
        pid = int(worker.split(":")[-1])
        steps[rid].append({"attempt": attempt, "status": status, "pid": pid, "error": error})
    executions, wrote = _load_executions(conn, list(runs))
    query = (
        "SELECT kind, count(*) FROM durable_activity WHERE run_id = ANY(%s) "
        "AND kind IN ('stale_recovered', 'worker_fenced') GROUP BY kind"
    )
    activity = dict(conn.execute(query, (list(runs),)).fetchall())
    return LedgerSnapshot(runs, rows, balances, steps, executions, wrote, activity)


def _load_executions(
    conn: psycopg.Connection[Any], run_ids: list[str]
) -> tuple[dict[str, list[Execution]], set[tuple[str, int, int, int, int]]]:
    """The executions of ``book`` from the chaos ledger, in claim order, and those past their writes."""
    executions: dict[str, list[Execution]] = defaultdict(list)
    phases: dict[str, Any] = {"wrote": set(), "end": set(), "done": {}}
    query = (
        "SELECT run_id, attempt, fence, pid, thread, worker, phase, at FROM chaos_ledger "
        "WHERE step = %s AND run_id = ANY(%s) ORDER BY at"
    )
    for rid, attempt, fence, pid, thread, worker, phase, at in conn.execute(query, (BOOK, run_ids)):
        if phase == "begin":
            executions[rid].append(Execution(rid, BOOK, attempt, fence, pid, worker, at, thread=thread))
        elif phase == "done":
            phases["done"][(rid, attempt, fence, pid, thread)] = at
        else:
            phases[phase].add((rid, attempt, fence, pid, thread))
    for execs in executions.values():
        for e in execs:
            e.ended = (e.run_id, e.attempt, e.fence, e.pid, e.thread) in phases["end"]
            e.done = phases["done"].get((e.run_id, e.attempt, e.fence, e.pid, e.thread))
        execs.sort(key=lambda e: (e.fence, e.at))
    return executions, phases["wrote"]


def _past_writes(snap: LedgerSnapshot, e: Execution) -> bool:
    """Did execution ``e`` get past its writes (its ``wrote`` row)?"""
    return (e.run_id, e.attempt, e.fence, e.pid, e.thread) in snap.wrote


def _recorded(execs: list[Execution], rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Executions a step row records (its attempt and process, not a WorkerLost its worker
    wrote for it; the newest fence of that process and attempt), by index, with the row."""
    chosen = {}
    for row in rows:
        if row["error"] == "WorkerLost":
            continue
        same = [i for i, e in enumerate(execs) if e.attempt == row["attempt"] and e.pid == row["pid"]]
        if same:
            chosen[max(same, key=lambda i: execs[i].fence)] = row
    return chosen


def check_ledger(snap: LedgerSnapshot, report: Report) -> list[str]:
    """The violations of exactly-once: a completed run with no ledger row or several, a failed
    or cancelled run with one, a row that the recorded execution did not write, a balance that
    is not the sum of its completed runs' amounts. Duplicates are counted by cause."""
    violations: list[str] = []
    sums: dict[int, int] = defaultdict(int)
    for rid, run in snap.runs.items():
        if run["status"] == "completed":
            sums[run["input"]["account"]] += run["input"]["amount"]
        _check_rows(snap, rid, report, violations)
    for account, total in sorted(snap.balances.items()):
        if total != sums.get(account, 0):
            violations.append(
                f"account {account}: balance {total}, but its completed runs add up to {sums.get(account, 0)}"
            )
    for rid in set(snap.rows) - set(snap.runs):
        violations.append(f"ledger rows of run {rid}, which is not a run of the scenario: {snap.rows[rid]}")
    report.counts["ledger violations"] = len(violations)
    return violations


def _check_rows(snap: LedgerSnapshot, rid: str, report: Report, violations: list[str]) -> None:
    """One run's ledger rows: one if it completed (the recorded execution's), else none."""
    rows, data, status = snap.rows.get(rid, []), snap.runs[rid]["input"], snap.runs[rid]["status"]
    report.counts["ledger rows"] += len(rows)
    if status == "completed" and len(rows) != 1:
        violations.append(f"run {rid} completed with {len(rows)} ledger rows: {rows}")
    elif status != "completed" and rows:
        report.counts[f"ledger rows of {status} runs"] += len(rows)
        violations.append(f"run {rid} ended {status} with {len(rows)} ledger rows: {rows}")
    if len(rows) > 1 or (rows and status != "completed"):
        for cause in sorted({c for row in rows if (c := _extra_cause(snap, rid, row)) is not None}):
            report.counts[f"runs booked in an execution that did not complete, {cause}"] += 1
    for row in rows:
        if (row["account"], row["amount"]) != (data["account"], data["amount"]):
            violations.append(f"run {rid}: a ledger row of another booking: {row}")
    if status == "completed" and len(rows) == 1 and rid in snap.steps:  # a pruned run has no step rows
        _check_row_writer(snap, rid, rows[0], violations)


def _extra_cause(snap: LedgerSnapshot, rid: str, row: dict[str, Any]) -> str | None:
    """Why a row was written by an execution that did not complete (None: it did): the step
    raised after its writes (its own failure, recorded), or a fault made it run again."""
    execs = snap.executions.get(rid, [])
    for i, step in _recorded(execs, snap.steps.get(rid, [])).items():
        if (execs[i].attempt, execs[i].fence, execs[i].pid) == (row["attempt"], row["fence"], row["pid"]):
            if step["status"] == "completed":
                return None
            if step["error"] == "Declined":
                return "as it raised"
    return "and run again after a fault"


def _check_row_writer(snap: LedgerSnapshot, rid: str, row: dict[str, Any], violations: list[str]) -> None:
    """The row that stayed was written by the execution durable recorded as completed."""
    execs = snap.executions.get(rid, [])
    recorded = _recorded(execs, snap.steps.get(rid, []))
    writers = [
        (execs[i].attempt, execs[i].fence, execs[i].pid)
        for i, r in recorded.items()
        if r["status"] == "completed"
    ]
    if writers != [(row["attempt"], row["fence"], row["pid"])]:
        violations.append(f"run {rid}: its ledger row {row} is not the recorded execution's {writers}")


def _failed_with(run: dict[str, Any]) -> tuple[str, ...]:
    """The errors a run told to fail on every attempt may end with."""
    return FAILED_WITH + (OWN_CONNECTION_BROKEN if run.get("workflow") == PLAIN else ())


def check_runs(
    snap: LedgerSnapshot,
    starts: list[Start],
    inputs: dict[str, dict[str, Any]],
    cancels: dict[str, Any],
    faults: FaultLog,
    report: Report,
) -> None:
    """Every returned run exists and ended as its input and its cancel say; starts raised
    nothing but ``DatabaseUnavailable``, during the outage."""
    for rid in inputs:
        run = snap.runs.get(rid)
        if run is None:
            report.lost += 1
            report.problem(f"start returned run {rid}, which does not exist")
            continue
        report.started += 1
        status, data, cancel = run["status"], run["input"], cancels.get(rid)
        report.completed += status == "completed"
        report.failed += status == "failed"
        report.cancelled += status == "cancelled"
        if data["cancel_in"] is not None and (cancel is None or cancel.result is None):
            report.problem(f"run {rid}: its cancel was never answered: {cancel}")
        cancelled = cancel is not None and cancel.result is True
        if cancel is not None:
            report.counts[f"cancels answered {cancel.result}"] += 1
        wanted = ("failed",) if data["fail"] == "always" else ("completed",)
        if status in UNFINISHED:
            report.stuck += 1
            report.problem(f"run {rid} is still {status}")
        elif cancelled and status != "cancelled":
            report.problem(f"run {rid}: a cancel returned True, but it ended {status}")
        elif not cancelled and status not in wanted:
            report.problem(f"run {rid} ended {status}, not {wanted[0]}: {run['error']}")
        elif status == "failed" and run["error"].get("type") not in _failed_with(run):
            report.problem(f"run {rid} failed with {run['error']}, not its own Declined")
    for rid in set(snap.runs) - set(inputs):
        report.problem(f"run {rid} was started by nobody")
    answered = {rid: {"key": None} for rid in snap.runs}
    check_starts(Snapshot(answered, {}, {}, []), starts, faults, report)


def check_executions(snap: LedgerSnapshot, faults: FaultLog, report: Report) -> None:
    """Each execution of ``book`` that durable did not record is explained (a fault hit its
    process while it ran, a PostgreSQL outage broke its transaction, or a cancel cut the last
    one short); executions run again after their writes are counted by what hit them."""
    outages = [fault for fault in faults.faults if fault.kind.startswith("pg_")]
    for rid, execs in snap.executions.items():
        report.executions += len(execs)
        recorded = _recorded(execs, snap.steps.get(rid, []))
        cancelled = snap.runs[rid]["status"] == "cancelled"
        for i, e in enumerate(execs):
            wrote = _past_writes(snap, e)
            report.counts["book executions past their writes"] += wrote
            if i in recorded:
                if recorded[i]["error"] == "DatabaseUnavailable":
                    report.counts["book attempts used by the database outage"] += 1
                continue
            if cancelled and i == len(execs) - 1:
                report.counts["book cut short by a cancel"] += 1
                continue
            fault = faults.explaining(e.pid, e.at, e.done, rid, e.fence, RERUN_FAULTS)
            cause = fault.kind if fault is not None else _outage(outages, e)
            if cause is None:
                report.unexplained += 1
                done = f"{e.done:.3f}" if e.done is not None else "never"
                report.problem(
                    f"run {rid} book attempt {e.attempt} ran in process {e.pid} ({e.worker}, fence "
                    f"{e.fence}, begun {e.at:.3f}, done {done}) and ran again; no fault hit it while it ran"
                )
                continue
            report.explained += 1
            if wrote:
                report.counts[f"book run again after its writes, by {cause}"] += 1
    for rows in snap.steps.values():
        report.counts["WorkerLost attempts"] += sum(row["error"] == "WorkerLost" for row in rows)
    for kind, n in snap.activity.items():
        report.counts[kind] += n


def _outage(outages: list[Any], e: Execution) -> str | None:
    """The PostgreSQL outage that broke execution ``e``'s transaction, if one was on meanwhile."""
    for fault in outages:
        if e.at <= fault.t1 + OUTAGE_REACH and (e.done is None or e.done >= fault.t0 - OUTAGE_REACH):
            return str(fault.kind)
    return None


def check_ledger_scenario(
    conn: psycopg.Connection[Any],
    report: Report,
    workflow: str,
    starts: list[Start],
    inputs: dict[str, dict[str, Any]],
    cancels: dict[str, Any],
    faults: FaultLog,
) -> list[str]:
    """Every check of the scenario into ``report``; returns the ledger's violations (problems of
    the report too when ``book`` is atomic)."""
    snap = load_ledger(conn, workflow)
    report.faults = faults.count()
    report.counts[f"faults aimed at {workflow}'s book past its writes"] = sum(
        bool(fault.detail.get("targeted")) and fault.detail.get("workflow") == workflow
        for fault in faults.faults
    )
    check_runs(snap, starts, inputs, cancels, faults, report)
    check_executions(snap, faults, report)
    violations = check_ledger(snap, report)
    if workflow == ATOMIC:
        for violation in violations[:SHOWN]:
            report.problem(f"ledger: {violation}")
        if len(violations) > SHOWN:
            report.problem(f"ledger: {len(violations) - SHOWN} more violations")
    again = sum(n for name, n in report.counts.items() if name.startswith("book run again after its writes"))
    if not again:
        report.problem("no execution of book ran again after its writes: the faults proved nothing")
    return violations


def check_soak_ledger(
    conn: psycopg.Connection[Any],
    report: Report,
    inputs: dict[str, dict[str, Any]],
    faults: FaultLog,
) -> list[str]:
    """The soak's ``ledger_atomic`` runs, at its end: each started run finished (present, or
    pruned: its status kept in ``chaos_pruned``), the ledger holds one row per completed run and
    none for another, the balances add up, and every extra execution of ``book`` of the runs
    still present is explained by a fault. The violations are problems of ``report``."""
    snap = load_ledger(conn, ATOMIC)
    pruned = conn.execute("SELECT id, status FROM chaos_pruned WHERE workflow = %s", (ATOMIC,)).fetchall()
    for rid, status in pruned:
        if rid not in snap.runs and rid in inputs:
            snap.runs[rid] = {"status": status, "error": {}, "input": inputs[rid]}
    report.counts["atomic runs pruned"] = len(pruned)
    for rid in inputs:
        status = snap.runs.get(rid, {}).get("status")
        report.counts[f"atomic runs {status}"] += 1
        if status is None or status in UNFINISHED:
            report.problem(f"atomic run {rid} is {status or 'lost'}")
    executions, report.executions = report.executions, 0
    check_executions(snap, faults, report)  # only the runs still present have their step rows
    report.counts["atomic book executions"], report.executions = report.executions, executions
    violations = check_ledger(snap, report)
    for violation in violations[:SHOWN]:
        report.problem(f"ledger: {violation}")
    return violations
