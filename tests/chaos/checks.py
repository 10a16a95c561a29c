"""What a chaos scenario must show afterwards, from the database and the ledger, and its table.

- Every started run reached the status its workflow leads to (``workflows.EXPECTED``); none is
  lost (a returned id with no run) or stuck (unfinished once the faults stopped, within a bound).
- An execution is *recorded* when a ``durable_steps`` row of its attempt names its process; the
  execution recorded must hold the newest fencing token of its attempt (no step recorded by a
  fenced worker). Every other execution ran again later and must be explained by a fault that
  hit its process while it was in progress (begun before the fault, not done before it:
  ``faults.Fault.hit``), or be the last one of a run that a newer start cancelled; the rest are
  *unexplained*.
- Attempts: every attempt before an execution's own was used by a recorded failure; a
  ``WorkerLost`` failure comes only from a killed pool process, recorded within
  ``LOST_RECORDED_WITHIN`` s, and every killed step process used one (unless its worker went
  down within that time too, or a sweep took its lock first, within that time);
  a lost node uses none: the step's next execution has the same attempt.
- A stale take-back, a fenced result and a hand-back each name a process a fault hit, written
  within a bounded window around it (``faults.Fault.caused``).
- Nothing half-written (``CONSISTENCY``): no key row, step row or event of a missing run, no key
  row naming a run of another key, no finished run still locked, no completed run without a
  completed step row for each step.
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

from tests.chaos.faults import CAUSED_BEFORE, NODE_FAULTS, Fault, FaultLog
from tests.chaos.load import KeySampler, Start
from tests.chaos.workflows import EXPECTED, STEPS

UNFINISHED = ("pending", "running", "waiting", "compensating")
RERUN_FAULTS = ("kill_child", *NODE_FAULTS)  # faults after which a step may run again
OUTAGE_MARGIN = 15.0  # seconds after a database outage in which a start may still be refused
SHOWN = 12  # problems listed in a failure message
# The worker that forked a killed pool process records its attempt as used "at once" (lost.py:
# Celery's SIGCHLD handler); 5 s leaves room for a starved CPU.
LOST_RECORDED_WITHIN = 5.0
# Whichever sees a killed pool process first ends its attempt: its worker (a WorkerLost failure,
# one attempt used) or, when Celery sees the death late, the stale sweep (no attempt, as for a
# lost node). A sweep of its lock up to LOST_RECORDED_WITHIN s after the kill is that race; a
# later one is the recovery of a loss its worker failed to record, which the rules do not allow.
SWEPT_FIRST_WITHIN = LOST_RECORDED_WITHIN


@dataclass
class Execution:
    """One execution of a step, from its ledger rows."""

    run_id: str
    step: int
    attempt: int
    fence: int
    pid: int
    worker: str
    at: float  # when it began
    ended: bool = False  # its body ran to the end
    done: float | None = None  # when the library was done with it (None: never, e.g. killed)
    thread: int = 0


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
    ended, done = set(), {}
    ledger = (
        "SELECT run_id, step, attempt, fence, pid, thread, worker, phase, at FROM chaos_ledger "
        "WHERE run_id = ANY(%s)"
    )
    for rid, step, attempt, fence, pid, thread, worker, phase, at in conn.execute(ledger, (ids,)):
        if phase == "begin":
            executions[rid].append(Execution(rid, step, attempt, fence, pid, worker, at, thread=thread))
        elif phase == "end":
            ended.add((rid, step, attempt, fence, pid, thread))
        else:
            done[(rid, step, attempt, fence, pid, thread)] = at
    for execs in executions.values():
        for e in execs:
            e.ended = (e.run_id, e.step, e.attempt, e.fence, e.pid, e.thread) in ended
            e.done = done.get((e.run_id, e.step, e.attempt, e.fence, e.pid, e.thread))
        execs.sort(key=lambda e: (e.step, e.attempt, e.fence, e.at))
    steps: dict[str, list[dict[str, Any]]] = defaultdict(list)
    query = (
        "SELECT run_id, step_index, attempt, status, worker, error->>'type', extract(epoch from finished_at) "
        "FROM durable_steps WHERE phase = 'step' AND run_id = ANY(%s)"
    )
    for rid, step, attempt, status, worker, error, at in conn.execute(query, (ids,)):
        pid = int(worker.split(":")[-1])
        steps[rid].append(
            {"step": step, "attempt": attempt, "status": status, "pid": pid, "error": error, "at": float(at)}
        )
    activity = []
    query = (
        "SELECT kind, run_id, details, extract(epoch from at) FROM durable_activity "
        "WHERE kind IN ('stale_recovered', 'worker_fenced', 'handed_back') AND run_id = ANY(%s)"
    )
    for kind, rid, details, at in conn.execute(query, (ids,)):
        activity.append({"kind": kind, "run_id": rid, "details": details, "at": float(at)})
    return Snapshot(runs, executions, steps, activity)


def check_runs(
    snap: Snapshot,
    starts: list[Start],
    report: Report,
    stuck_ok: bool = False,
    accounted: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Statuses, lost runs, runs nobody started. A returned id in ``accounted`` (checked before,
    or pruned) is not lost."""
    returned = {rec.run_id for rec in starts if rec.run_id}
    tags = {rec.tag for rec in starts}
    lost = sorted(returned - set(snap.runs) - set(accounted))
    report.lost += len(lost)
    for rid in lost[:SHOWN]:
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
    swept: dict[tuple[str, int], list[float]] = defaultdict(list)  # (run, process) -> take-back times
    for entry in snap.activity:
        if entry["kind"] == "stale_recovered":
            swept[(entry["run_id"], _pid_of((entry["details"] or {}).get("locked_by")))].append(entry["at"])
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


def _next(execs: list[Execution], e: Execution) -> Execution | None:
    """The step's execution after ``e``: the next claim, with the next fencing token."""
    later = [x for x in execs if x.fence > e.fence]
    return min(later, key=lambda x: (x.fence, x.at)) if later else None


def _check_step(
    run: dict[str, Any],
    rid: str,
    execs: list[Execution],
    rows: list[dict[str, Any]],
    last: Execution,
    faults: FaultLog,
    report: Report,
    swept: dict[tuple[str, int], list[float]],
) -> None:
    """The executions of one step of one run against its step rows and the faults."""
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
        fault = faults.explaining(e.pid, e.at, e.done, rid, e.fence, RERUN_FAULTS)
        if fault is None:
            report.unexplained += 1
            done = f"{e.done:.3f}" if e.done is not None else "never"
            report.problem(
                f"{where} attempt {e.attempt} ran in process {e.pid} thread {e.thread} ({e.worker}, "
                f"fence {e.fence}, begun {e.at:.3f}, done {done}) and ran again, and no fault hit that "
                "process while it was in progress"
            )
            continue
        report.explained += 1
        report.counts[f"extra executions after {fault.kind}"] += 1
        _check_attempt_use(
            where, e, _next(execs, e), rows, fault, faults, report, swept.get((rid, e.pid), [])
        )
    for row in rows:
        if row["error"] == "WorkerLost":
            report.counts["WorkerLost attempts"] += 1
            _check_worker_lost(where, row, faults, report)


def _check_worker_lost(where: str, row: dict[str, Any], faults: FaultLog, report: Report) -> None:
    """A ``WorkerLost`` attempt belongs to a pool process killed at most ``LOST_RECORDED_WITHIN`` s
    before it was recorded."""
    kills = [f for f in faults.faults if f.kind == "kill_child" and row["pid"] in f.pids]
    lags = [row["at"] - f.t0 for f in kills if row["at"] is not None and row["at"] >= f.t0]
    if not lags:
        report.problem(
            f"{where} attempt {row['attempt']}: WorkerLost charged to process {row['pid']}, "
            "which was not a killed pool process"
        )
    elif min(lags) > LOST_RECORDED_WITHIN:
        report.problem(
            f"{where} attempt {row['attempt']}: WorkerLost of process {row['pid']} recorded "
            f"{min(lags):.1f}s after the kill (more than {LOST_RECORDED_WITHIN:.0f}s)"
        )
    else:
        slowest = "WorkerLost recorded after the kill, slowest ms"
        report.counts[slowest] = max(report.counts[slowest], round(min(lags) * 1000))


def _check_attempt_use(
    where: str,
    e: Execution,
    nxt: Execution | None,
    rows: list[dict[str, Any]],
    fault: Fault,
    faults: FaultLog,
    report: Report,
    swept: list[float],
) -> None:
    """A killed step process uses its attempt; a lost node uses none; the step's next execution
    runs the attempt that follows from that. (A pool process whose lock a sweep took back from
    just before its kill to ``SWEPT_FIRST_WITHIN`` s after, before its worker recorded the loss,
    had lost its run to the sweep: no attempt either; counted apart.)"""
    used = any(r["attempt"] == e.attempt and r["pid"] == e.pid and r["error"] == "WorkerLost" for r in rows)
    if fault.kind == "kill_child" and not used:
        if any(fault.t0 - CAUSED_BEFORE <= at <= fault.t0 + SWEPT_FIRST_WITHIN for at in swept):
            report.counts["killed pool process swept before its worker saw it"] += 1
        elif _worker_went_soon(faults, fault):
            report.counts["killed pool process whose worker went down before recording it"] += 1
        else:
            report.problem(
                f"{where} attempt {e.attempt}: its process {e.pid} was killed at {fault.t0:.3f} (begun "
                f"{e.at:.3f}), but no attempt was used and no sweep had taken its lock first"
            )
    if fault.kind in NODE_FAULTS and used:
        report.problem(f"{where} attempt {e.attempt}: a lost node ({fault.kind}) used an attempt")
    if nxt is not None and nxt.attempt != e.attempt + used:
        report.problem(
            f"{where}: attempt {e.attempt} was lost to {fault.kind} ({int(used)} attempt used), "
            f"but the next execution ran attempt {nxt.attempt}"
        )


def _worker_went_soon(faults: FaultLog, child: Fault) -> bool:
    """Was the worker of a killed pool process itself killed before it could record the loss?"""
    return any(
        f.kind in ("kill_node", "kill_parent")
        and f.worker == child.worker
        and 0 <= f.t0 - child.t0 < LOST_RECORDED_WITHIN
        for f in faults.faults
    )


def _pid_of(node: str | None) -> int:
    """The process id in a ``host:pid[:thread]`` node name (-1 without one)."""
    return int(node.split(":")[1]) if node and node.count(":") >= 1 else -1


def check_activity(snap: Snapshot, faults: FaultLog, report: Report) -> None:
    """Stale take-backs, fenced results and hand-backs name processes that a fault hit around then."""
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
        if faults.causing(pid, entry["at"], allowed) is None:
            report.problem(
                f"run {entry['run_id']}: {kind} names process {pid}, which no fault hit around then: "
                f"{details}"
            )


def check_starts(
    snap: Snapshot,
    starts: list[Start],
    faults: FaultLog,
    report: Report,
    keys: dict[str, str | None] | None = None,
) -> None:
    """Only clear, expected errors; each answer names a run with the key asked for (``keys``:
    the keys of runs checked before, no longer in ``snap``)."""
    known_keys = {**(keys or {}), **{rid: run["key"] for rid, run in snap.runs.items()}}
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
        if rec.key is not None and answer in known_keys and known_keys[answer] != rec.key:
            report.problem(
                f"start with key {rec.key} ({rec.policy}) answered with run {answer} of another key"
            )


def worked_after(snap: Snapshot, since: float) -> dict[str, int]:
    """Step executions begun after ``since``, per worker."""
    counts: dict[str, int] = defaultdict(int)
    for execs in snap.executions.values():
        for e in execs:
            if e.at > since:
                counts[e.worker] += 1
    return counts


def check_worked_after(
    report: Report, snap: Snapshot, workers: Iterable[str], since: float, what: str
) -> None:
    """Every worker began steps after ``since`` (the end of ``what``): it reconnected by itself."""
    counts = worked_after(snap, since)
    for name in workers:
        report.counts[f"steps begun after {what} by {name}"] = counts.get(name, 0)
        if not counts.get(name):
            report.problem(f"worker {name} began no step after {what} ended: did it reconnect?")


# One statement, so one snapshot. Each row: what is half-written, and the runs it names.
CONSISTENCY = f"""
SELECT 'a key row whose holder run is missing', ARRAY[k.holder_id::text] FROM durable_keys k
    WHERE NOT EXISTS (SELECT 1 FROM durable_runs r WHERE r.id = k.holder_id)
UNION ALL
SELECT 'a key row whose holder run has another key', ARRAY[k.holder_id::text] FROM durable_keys k
    JOIN durable_runs r ON r.id = k.holder_id
    WHERE r.key IS DISTINCT FROM k.key OR r.workflow <> k.workflow
UNION ALL
SELECT 'a key row whose waiting run is missing or not waiting behind it',
       ARRAY[k.holder_id::text, k.waiting_id::text] FROM durable_keys k
    LEFT JOIN durable_runs w ON w.id = k.waiting_id
    WHERE k.waiting_id IS NOT NULL AND (w.id IS NULL OR w.key IS DISTINCT FROM k.key
        OR (w.status = 'waiting' AND w.runs_after_id IS DISTINCT FROM k.holder_id))
UNION ALL
SELECT 'an unfinished keyed run neither holding its key nor waiting in its key row', ARRAY[r.id::text]
    FROM durable_runs r
    WHERE r.key IS NOT NULL AND r.status IN ('pending', 'running', 'waiting', 'compensating')
      AND NOT EXISTS (SELECT 1 FROM durable_keys k WHERE k.workflow = r.workflow AND k.key = r.key
                      AND r.id IN (k.holder_id, k.waiting_id))
UNION ALL
SELECT 'step rows of a missing run', array_agg(DISTINCT s.run_id::text) FROM durable_steps s
    WHERE NOT EXISTS (SELECT 1 FROM durable_runs r WHERE r.id = s.run_id) HAVING count(*) > 0
UNION ALL
SELECT 'events of a missing run', array_agg(DISTINCT e.run_id::text) FROM durable_events e
    WHERE NOT EXISTS (SELECT 1 FROM durable_runs r WHERE r.id = e.run_id) HAVING count(*) > 0
UNION ALL
SELECT 'a finished run still locked or without its finish time', ARRAY[r.id::text] FROM durable_runs r
    WHERE r.status NOT IN ('pending', 'running', 'waiting', 'compensating')
      AND (r.locked_by IS NOT NULL OR r.finished_at IS NULL)
UNION ALL
SELECT 'a completed run without a completed step row for each of its steps', ARRAY[r.id::text]
    FROM durable_runs r
    WHERE r.status = 'completed' AND (
        SELECT count(DISTINCT s.step_index) FROM durable_steps s
        WHERE s.run_id = r.id AND s.phase = 'step' AND s.status = 'completed') <> {len(STEPS)}
UNION ALL
SELECT 'a step with two completed rows', ARRAY[s.run_id::text] FROM durable_steps s
    WHERE s.phase = 'step' AND s.status = 'completed' GROUP BY s.run_id, s.step_index HAVING count(*) > 1
"""


def check_consistency(conn: psycopg.Connection[Any], report: Report) -> None:
    """The database holds nothing half-written (``CONSISTENCY``), checked once the runs are quiet."""
    rows = conn.execute(CONSISTENCY).fetchall()
    report.counts["half-written rows found"] = len(rows)
    for what, ids in rows[:SHOWN]:
        report.problem(f"consistency: {what}: {ids[:5]}")


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
    earlier: dict[str, str | None] | None = None,
) -> Snapshot:
    """Every check but the sampler's and the consistency query, into ``report``. ``earlier``:
    runs accounted for before (checked, or pruned), with their keys: an answer naming one is
    neither lost nor unchecked."""
    snap = load(conn, run_ids)
    report.faults = faults.count()
    check_runs(snap, starts, report, stuck_ok, accounted=set(earlier or ()))
    check_executions(snap, faults, report)
    check_activity(snap, faults, report)
    check_starts(snap, starts, faults, report, earlier)
    return snap
