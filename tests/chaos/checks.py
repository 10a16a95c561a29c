"""What a chaos scenario must show afterwards, from the database and the ledger, and its table.

- Every started run reached the status its workflow leads to (``workflows.EXPECTED``); none is
  lost (a returned id with no run) or stuck (unfinished once the faults stopped, within a bound).
- An execution is *recorded* when a ``durable_steps`` row of its attempt names its process; the
  execution recorded must hold the newest fencing token of its attempt (no step recorded by a
  fenced worker). Every other execution ran again later and must be explained by a fault that
  hit its process while it ran (``faults.FaultLog``), or be the last one of a run that a newer
  start cancelled; the rest are *unexplained*.
- Attempts: every attempt before an execution's own was used by a recorded failure; a
  ``WorkerLost`` failure comes only from a killed pool process, and every killed step process
  used one (unless its whole worker went down too); a lost node uses none.
- A stale take-back, a fenced result and a hand-back each name a process a fault hit.
- Starts: no error but ``DatabaseUnavailable`` (during a database outage, saying so), ``KeyTaken``
  and ``KeyContended``; each returned id is a run with the key asked for; no run nobody started.
- The key sampler found no key with two unfinished holders (``load.KEY_INVARIANTS``).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from tests.chaos.faults import NODE_FAULTS, FaultLog
from tests.chaos.load import KeySampler, Start
from tests.chaos.workflows import EXPECTED

UNFINISHED = ("pending", "running", "waiting", "compensating")
RERUN_FAULTS = ("kill_child", *NODE_FAULTS)  # faults after which a step may run again
OUTAGE_MARGIN = 15.0  # seconds after a database outage in which a start may still be refused
SHOWN = 12  # problems listed in a failure message


@dataclass
class Execution:
    """One execution of a step, from its ledger rows."""

    run_id: str
    step: int
    attempt: int
    fence: int
    pid: int
    worker: str
    at: float
    ended: bool = False


@dataclass
class Report:
    """The outcome of one scenario: counts for the table, and the problems found."""

    name: str
    started: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    lost: int = 0
    stuck: int = 0
    executions: int = 0
    explained: int = 0
    unexplained: int = 0
    recovery: float | None = None
    bound: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    problems: list[str] = field(default_factory=list)
    logs: str = ""  # the workers' logs, shown when there are problems

    HEADER = (
        f"{'scenario':<16}{'started':>8}{'completed':>10}{'failed':>7}{'cancel':>7}{'lost':>5}{'stuck':>6}"
        f"{'execs':>7}{'extra expl/unexpl':>19}{'recovery s':>11}"
    )

    def line(self) -> str:
        recovery = f"{self.recovery:.1f}" if self.recovery is not None else f">{self.bound:.0f}"
        extra = f"{self.explained}/{self.unexplained}"
        return (
            f"{self.name:<16}{self.started:>8}{self.completed:>10}{self.failed:>7}{self.cancelled:>7}"
            f"{self.lost:>5}{self.stuck:>6}{self.executions:>7}{extra:>19}{recovery:>11}"
        )

    def details(self) -> str:
        faults = ", ".join(f"{kind} {n}" for kind, n in sorted(self.faults.items())) or "none"
        counts = ", ".join(f"{name} {n}" for name, n in sorted(self.counts.items()))
        return f"  faults: {faults}\n  {counts}"

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def check(self) -> None:
        """Raise AssertionError naming the problems, if any."""
        if self.problems:
            shown = "\n  ".join(self.problems[:SHOWN])
            more = f"\n  ... and {len(self.problems) - SHOWN} more" if len(self.problems) > SHOWN else ""
            message = f"{self.name}: {len(self.problems)} problem(s)\n  {shown}{more}"
            raise AssertionError(f"{message}\n{self.logs}" if self.logs else message)


def table(reports: Iterable[Report]) -> str:
    """The chaos table: one line per scenario, then what each saw."""
    reports = list(reports)
    lines = [Report.HEADER, *(report.line() for report in reports), ""]
    for report in reports:
        lines += [f"{report.name}:", report.details()]
    return "\n".join(lines)


def wait_quiet(connect: Any, bound: float) -> tuple[float | None, int]:
    """Poll until no run is unfinished: (seconds it took or None, runs still unfinished)."""
    began = time.monotonic()
    left = -1
    while time.monotonic() - began < bound:
        try:
            with connect() as conn:
                left = conn.execute(
                    "SELECT count(*) FROM durable_runs WHERE status = ANY(%s)", (list(UNFINISHED),)
                ).fetchone()[0]
        except psycopg.OperationalError:
            left = -1
        if left == 0:
            return time.monotonic() - began, 0
        time.sleep(0.2)
    return None, left


@dataclass
class Snapshot:
    """What the database holds about the runs under check."""

    runs: dict[str, dict[str, Any]]
    executions: dict[str, list[Execution]]
    steps: dict[str, list[dict[str, Any]]]
    activity: list[dict[str, Any]]


def load(conn: psycopg.Connection[Any], run_ids: list[str] | None = None) -> Snapshot:
    """Runs (all, or ``run_ids``), their ledger, their step rows, and the fault-related activity."""
    where, args = ("WHERE id = ANY(%s)", (run_ids,)) if run_ids is not None else ("", ())
    runs = {}
    query = f"SELECT id, workflow, status, key, error, input->>'tag' FROM durable_runs {where}"
    for rid, workflow, status, key, error, tag in conn.execute(query, args):
        runs[rid] = {"workflow": workflow, "status": status, "key": key, "error": error, "tag": tag}
    ids = list(runs)
    executions: dict[str, list[Execution]] = defaultdict(list)
    ended = set()
    ledger = (
        "SELECT run_id, step, attempt, fence, pid, worker, phase, at FROM chaos_ledger WHERE run_id = ANY(%s)"
    )
    for rid, step, attempt, fence, pid, worker, phase, at in conn.execute(ledger, (ids,)):
        if phase == "begin":
            executions[rid].append(Execution(rid, step, attempt, fence, pid, worker, at))
        else:
            ended.add((rid, step, attempt, fence, pid))
    for execs in executions.values():
        for e in execs:
            e.ended = (e.run_id, e.step, e.attempt, e.fence, e.pid) in ended
        execs.sort(key=lambda e: (e.step, e.attempt, e.fence, e.at))
    steps: dict[str, list[dict[str, Any]]] = defaultdict(list)
    query = (
        "SELECT run_id, step_index, attempt, status, worker, error->>'type', extract(epoch from finished_at) "
        "FROM durable_steps WHERE phase = 'step' AND run_id = ANY(%s)"
    )
    for rid, step, attempt, status, worker, error, at in conn.execute(query, (ids,)):
        pid = int(worker.split(":")[-1])
        steps[rid].append(
            {"step": step, "attempt": attempt, "status": status, "pid": pid, "error": error, "at": at}
        )
    activity = []
    query = (
        "SELECT kind, run_id, details, extract(epoch from at) FROM durable_activity "
        "WHERE kind IN ('stale_recovered', 'worker_fenced', 'handed_back') AND run_id = ANY(%s)"
    )
    for kind, rid, details, at in conn.execute(query, (ids,)):
        activity.append({"kind": kind, "run_id": rid, "details": details, "at": float(at)})
    return Snapshot(runs, executions, steps, activity)


def check_runs(snap: Snapshot, starts: list[Start], report: Report, stuck_ok: bool = False) -> None:
    """Statuses, lost runs, runs nobody started."""
    returned = {rec.run_id for rec in starts if rec.run_id}
    tags = {rec.tag for rec in starts}
    report.lost += len(returned - set(snap.runs))
    for rid in sorted(returned - set(snap.runs))[:SHOWN]:
        report.problem(f"start returned run {rid}, which does not exist")
    report.started += len(returned & set(snap.runs))
    for rid, run in snap.runs.items():
        status = run["status"]
        report.completed += status == "completed"
        report.failed += status == "failed"
        report.cancelled += status == "cancelled"
        if run["tag"] not in tags:
            report.problem(f"run {rid} ({run['workflow']}) was started by nobody")
        elif rid not in returned:
            report.counts["unanswered starts that went through"] += 1  # counted in started, checked below
            report.started += 1
        if status in UNFINISHED:
            report.stuck += 1
            if not stuck_ok:
                report.problem(f"run {rid} ({run['workflow']}) is still {status}")
        elif status not in EXPECTED[run["workflow"]]:
            report.problem(f"run {rid} ({run['workflow']}) ended {status}: {run['error']}")
        elif status == "cancelled" and not (run["error"] or {}).get("replaced_by"):
            report.problem(f"run {rid} was cancelled, not replaced by a newer start: {run['error']}")


def check_executions(snap: Snapshot, faults: FaultLog, report: Report) -> None:
    """Recorded, fenced, extra and explained executions, and the attempt rules."""
    swept = {(a["run_id"], _pid_of((a["details"] or {}).get("locked_by"))) for a in snap.activity}
    for rid, execs in snap.executions.items():
        run = snap.runs[rid]
        report.executions += len(execs)
        rows = snap.steps.get(rid, [])
        last = max(execs, key=lambda e: e.at)
        for step in {e.step for e in execs}:
            mine = [e for e in execs if e.step == step]
            step_rows = [r for r in rows if r["step"] == step]
            _check_step(run, rid, mine, step_rows, last, faults, report, swept)


def _recorded(execs: list[Execution], rows: list[dict[str, Any]]) -> set[int]:
    """Indexes of the executions a step row records: its attempt, its process, not WorkerLost;
    the newest fence of that process and attempt."""
    chosen = set()
    for row in rows:
        if row["error"] == "WorkerLost":
            continue
        same = [i for i, e in enumerate(execs) if e.attempt == row["attempt"] and e.pid == row["pid"]]
        if same:
            chosen.add(max(same, key=lambda i: execs[i].fence))
    return chosen


def _check_step(
    run: dict[str, Any],
    rid: str,
    execs: list[Execution],
    rows: list[dict[str, Any]],
    last: Execution,
    faults: FaultLog,
    report: Report,
    swept: set[tuple[str, int]],
) -> None:
    where = f"run {rid} step {execs[0].step}"
    recorded = _recorded(execs, rows)
    failed_attempts = {r["attempt"] for r in rows if r["status"] == "failed"}
    for i, e in enumerate(execs):
        newest = max(x.fence for x in execs if x.attempt == e.attempt)
        if i in recorded and e.fence < newest:
            report.problem(
                f"{where} attempt {e.attempt} recorded by fenced process {e.pid} (fence {e.fence} < {newest})"
            )
        missing = [a for a in range(1, e.attempt) if a not in failed_attempts]
        if missing:
            report.problem(
                f"{where}: attempt {e.attempt} ran, but attempt(s) {missing} were used without a failure"
            )
        if i in recorded:
            continue
        if run["status"] == "cancelled" and e is last:
            report.counts["cut short by a cancel"] += 1
            continue
        fault = faults.explaining(e.pid, e.at, rid, e.fence, RERUN_FAULTS)
        if fault is None:
            report.unexplained += 1
            report.problem(
                f"{where} attempt {e.attempt} ran in process {e.pid} ({e.worker}, fence {e.fence}, "
                f"ended={e.ended}) and ran again, and no fault hit that process then"
            )
            continue
        report.explained += 1
        _check_attempt_use(where, e, rows, fault.kind, faults, report, (rid, e.pid) in swept)
    for row in rows:
        if row["error"] == "WorkerLost":
            report.counts["WorkerLost attempts"] += 1
            if faults.explaining(row["pid"], 0.0, kinds=("kill_child",)) is None:
                report.problem(
                    f"{where} attempt {row['attempt']}: WorkerLost charged to process {row['pid']}, "
                    "which was not a killed pool process"
                )


def _check_attempt_use(
    where: str,
    e: Execution,
    rows: list[dict[str, Any]],
    kind: str,
    faults: FaultLog,
    report: Report,
    swept: bool,
) -> None:
    """A killed step process uses its attempt; a lost node uses none. (A pool process whose lock
    a sweep took back, because no heartbeat of its got through for ``stale_lock_timeout``, has
    lost its run: killing it then uses no attempt. On a machine starved of CPU that happens to a
    process that is only slow; it is counted apart.)"""
    used = [r for r in rows if r["attempt"] == e.attempt and r["pid"] == e.pid and r["error"] == "WorkerLost"]
    if kind == "kill_child" and not used and swept:
        report.counts["killed after its lock was swept (starved)"] += 1
    elif kind == "kill_child" and not used:
        node_went = faults.explaining(e.pid, e.at, kinds=NODE_FAULTS)
        if node_went is None and not _parent_killed_soon(faults, e):
            report.problem(
                f"{where} attempt {e.attempt}: its process {e.pid} was killed (begun {e.at:.3f}), "
                "but no attempt was used and no sweep had taken its lock"
            )
    if kind in NODE_FAULTS and used:
        report.problem(f"{where} attempt {e.attempt}: a lost node ({kind}) used an attempt")


def _parent_killed_soon(faults: FaultLog, e: Execution) -> bool:
    """Was the worker of a killed pool process itself killed before it could record the loss?"""
    child = faults.explaining(e.pid, e.at, kinds=("kill_child",))
    if child is None:
        return False
    return any(
        f.kind == "kill_node" and f.worker == child.worker and 0 <= f.t0 - child.t0 < 15
        for f in faults.faults
    )


def _pid_of(node: str | None) -> int:
    """The process id in a ``host:pid[:thread]`` node name (-1 without one)."""
    return int(node.split(":")[1]) if node and node.count(":") >= 1 else -1


def check_activity(snap: Snapshot, faults: FaultLog, report: Report) -> None:
    """Stale take-backs, fenced results and hand-backs name processes that a fault hit."""
    for entry in snap.activity:
        details = entry["details"] or {}
        pid = _pid_of(details.get("locked_by") or details.get("node"))
        kind = entry["kind"]
        report.counts[kind] += 1
        # A worker_fenced entry may name a killed pool process: its worker recorded the loss
        # after another path had taken the run back (engine.record_lost).
        allowed = {"stale_recovered": RERUN_FAULTS, "worker_fenced": RERUN_FAULTS, "handed_back": ("term",)}[
            kind
        ]
        if faults.explaining(pid, entry["at"], kinds=allowed, after=True) is None:
            report.problem(
                f"run {entry['run_id']}: {kind} names process {pid}, which no fault hit: {details}"
            )


def check_starts(snap: Snapshot, starts: list[Start], faults: FaultLog, report: Report) -> None:
    """Only clear, expected errors; each answer names a run with the key asked for."""
    outages = [f for f in faults.faults if f.kind.startswith("pg_")]
    for rec in starts:
        report.counts[f"starts {rec.outcome}"] += 1
        for at, kind, message in rec.errors:
            report.counts[f"start tries refused: {kind}"] += 1
            during = any(f.t0 - 1 <= at <= f.t1 + OUTAGE_MARGIN for f in outages)
            if kind != "DatabaseUnavailable" or "database unavailable" not in message or not during:
                report.problem(
                    f"start of {rec.workflow} {rec.tag} raised {kind} (outage: {during}): {message}"
                )
        if rec.outcome in ("gave_up", "unexpected"):
            report.problem(f"start of {rec.workflow} {rec.tag} ended {rec.outcome}: {rec.errors[-1:]}")
        answer = rec.run_id or rec.holder
        known = answer is not None and answer in snap.runs
        if rec.key is not None and known and snap.runs[answer]["key"] != rec.key:
            report.problem(
                f"start with key {rec.key} ({rec.policy}) answered with run {answer} of another key"
            )


def check_sampler(sampler: KeySampler, report: Report) -> None:
    report.counts["key samples"] = sampler.samples
    for at, what, workflow, key, ids in sampler.violations[:SHOWN]:
        report.problem(
            f"key sampler at {time.strftime('%H:%M:%S', time.localtime(at))}: {what}: {workflow} {key} {ids}"
        )
    if len(sampler.violations) > SHOWN:
        report.problem(f"key sampler: {len(sampler.violations) - SHOWN} more violations")
    if sampler.samples == 0:
        report.problem("the key sampler took no sample")


def describe_runs(conn: psycopg.Connection[Any], text: str, limit: int = 10) -> str:
    """Everything the database holds about the runs named in ``text`` (the problems), to keep
    beside the logs of a failed scenario."""
    uuid = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    ids = list(dict.fromkeys(re.findall(uuid, text)))
    out = []
    queries = {
        "run": "SELECT * FROM durable_runs WHERE id = %s",
        "ledger": "SELECT * FROM chaos_ledger WHERE run_id = %s ORDER BY at",
        "steps": "SELECT step_index, phase, attempt, status, worker, error->>'type', error->>'message', "
        "started_at, finished_at FROM durable_steps WHERE run_id = %s ORDER BY finished_at",
        "activity": "SELECT kind, details, at FROM durable_activity WHERE run_id = %s ORDER BY at",
    }
    for rid in ids[:limit]:
        out.append(f"== run {rid}")
        for name, query in queries.items():
            out += [f"  {name}: {row}" for row in conn.execute(query, (rid,))]
    return "\n".join(out)


def analyze(
    conn: psycopg.Connection[Any],
    report: Report,
    starts: list[Start],
    faults: FaultLog,
    run_ids: list[str] | None = None,
    stuck_ok: bool = False,
) -> Snapshot:
    """Every check but the sampler's, into ``report``."""
    snap = load(conn, run_ids)
    report.faults = faults.count()
    check_runs(snap, starts, report, stuck_ok)
    check_executions(snap, faults, report)
    check_activity(snap, faults, report)
    check_starts(snap, starts, faults, report)
    return snap
