"""Flow control per key, decided by the database: concurrency slots, throttle, rate limit.

A workflow's options (``limits.FlowLimit``) give each new run up to three keys (``runs.slot_key``,
``throttle_key``, ``rate_key``; ``''`` when a limit covers the whole workflow). Each decision
takes its key's lock (a PostgreSQL advisory lock for the transaction; SQLite's one writer) and
counts the key's runs, bounded by the limit, over partial indexes:

- **rate_limit**, at the start, after the key decision chose to create a run: at most ``limit``
  runs created per ``period``; beyond it ``RateLimited`` and nothing written.
- **throttle**, at the claim of a run's first step: at most ``limit`` runs begin per ``period``.
  A run that may not begin yet is parked (``flow_wait='throttle'``) due when the window should
  let it, and looks again then; runs waiting to begin go in line order.
- **concurrency**, at every claim of a step: a step may run while fewer than ``limit`` steps of
  its key run and wait ahead of it in line. A refused run is parked (``flow_wait='slot'``,
  not due, holding no worker and no connection) until a slot frees: whoever frees one (the
  step's end, ``release``) or parks wakes the runs first in line, and every worker's upkeep
  (``SlotWaker``) fills free slots a crash left. A step holds its slot while its run is
  locked, so a dead worker's slot comes back when its lock goes stale (or at once, WorkerLost).
  Compensations neither wait for nor hold a slot.

The line is ``runs.line_at``: the run's start, moved earlier by its priority (aged by the
``priority_aging`` setting) and, under a fair limit, set to its fair key's next turn at its start
(``_line_up``); runs with equal places go by id.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..errors import RateLimited
from ..models import aware
from ..store import activity_rows, flow_rows, queries
from ..store.flow_rows import SLOT, THROTTLE

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from ..definition import Step, Workflow
    from ..limits import FlowLimit
    from .runtime import Runtime

log = logging.getLogger("durable_celery")

# How far the throttle's line is counted to place a parked run's next look: 20 windows' worth
# of runs, at most this many (a run further back looks again then, and is placed again).
LINE_BOUND = 1000
LINE_WINDOWS = 20
# A run the throttle parks behind runs that may begin now looks again after this (seconds, or
# the period if shorter); one parked until a place frees looks again just after it frees (the
# margin covers the database's clock running ahead of this host's).
MIN_RECHECK = 0.25
CLOCK_MARGIN = 0.02
# Keys with parked runs the upkeep looks at per pass.
KEYS_PER_PASS = 200
# Under a fair limit a fair key's waiting runs are lined up this many seconds apart (divided by
# its weight): a backlog of 10,000 runs reaches 10 s past the head of the line.
FAIR_TURN = 0.001


def limited(workflow: Workflow) -> bool:
    """Does a claim of this workflow's steps go through flow control?"""
    return workflow.concurrency is not None or workflow.throttle is not None


# -- starts: rate_limit, and a place in line (fair share, priority) -----------------------------


def starts_in_transaction(workflow: Workflow, run: dict[str, Any]) -> bool:
    """Does this start read flow state before its run is written (a rate limit's window; a
    place in a concurrency limit's line, under a fair limit or with a priority), in a
    transaction of its own?"""
    return workflow.rate_limit is not None or _lined_up(workflow, run)


def _lined_up(workflow: Workflow, run: dict[str, Any]) -> bool:
    """Is the run placed in its slot key's line at its start (a fair limit, or a priority)?"""
    slots: FlowLimit | None = workflow.concurrency
    if slots is None or run.get("slot_key") is None:
        return False
    return slots.fair is not None or bool(run.get("priority"))


def admit_start_txn(rt: Runtime, conn: Connection, workflow: Workflow, run: dict[str, Any]) -> None:
    """Inside the start's transaction, before its run is written: RateLimited if the run's rate
    key had ``limit`` starts in the last ``period`` seconds (the key's lock is held until the
    transaction ends, so racing starts are counted one after another); under a fair limit or
    with a priority, the run takes its place in its slot key's line (``_line_up``)."""
    rate: FlowLimit | None = workflow.rate_limit
    if rate is not None:
        _admit_rate(rt, conn, rate, run)
    if _lined_up(workflow, run):
        assert workflow.concurrency is not None
        _line_up(rt, conn, workflow.concurrency, run)


def _admit_rate(rt: Runtime, conn: Connection, rate: FlowLimit, run: dict[str, Any]) -> None:
    """RateLimited if the run's rate key is full for now."""
    assert rate.period is not None
    db, name, key = rt.db, run["workflow"], run["rate_key"]  # a key for every run under a rate limit
    flow_rows.lock_key_txn(conn, "rate", name, key)
    full_since = flow_rows.window_full_since_txn(db, conn, name, key, rate.period, rate.limit)
    if full_since is None:
        return
    oldest = aware(full_since) or db.utcnow()
    retry_after = max((oldest + timedelta(seconds=rate.period) - db.utcnow()).total_seconds(), 0.0)
    raise RateLimited(name, key, rate.limit, rate.period, round(retry_after, 3))


def _line_up(rt: Runtime, conn: Connection, slots: FlowLimit, run: dict[str, Any]) -> None:
    """The run's place in line, and whether it waits from its start.

    Under a fair limit (start-time fair queuing) its place is its fair key's last place plus
    one turn (``FAIR_TURN`` over the key's weight), but never before the head of the line (the
    first parked run; now, when none is parked): so the slots go round the fair keys waiting,
    each in proportion to its weight, FIFO within one, and a key that waited for nothing queues
    behind nobody's backlog. A priority moves the place ``priority * priority_aging`` earlier.
    When runs of the key are parked already, or its slots are all in use or promised, the new
    run is parked at once (no message: the broker's queue holds no backlog of the key for it to
    wait behind, only the messages of runs woken in line order); a freed slot wakes it. The
    line is read without the key's lock (starts do not wait for claims and releases); a release
    that emptied the line meanwhile is caught after commit (``settle_parked_start``)."""
    name, slot_key, fair_key = run["workflow"], run["slot_key"], run.get("fair_key")
    turn = None
    if fair_key is not None:
        turn = timedelta(seconds=FAIR_TURN / slots.weight_of(fair_key, name))  # InvalidStart first
    line = flow_rows.fair_line_txn(rt.db, conn, name, slot_key, fair_key or "", slots.limit)
    if turn is not None:
        place = aware(line.head) or aware(line.now) or rt.db.utcnow()
        if line.tail is not None:
            place = max(place, (aware(line.tail) or place) + turn)
        run["line_at"] = place - timedelta(seconds=run.get("priority", 0) * rt.settings.priority_aging)
    full = line.head is not None or int(line.held) + int(line.due) >= slots.limit
    if full and run["published"]:
        run.update(flow_wait=SLOT, due_at=None, published=False)


# -- claims: throttle and concurrency -----------------------------------------------------------


def claim(rt: Runtime, workflow: Workflow, step: Step, run_id: str, node: str, compensate: bool) -> Any:
    """The claim of a step of a workflow with a throttle or concurrency limit: the run's row as
    ``queries.claim_run`` returns it, or None (not claimable, or parked by its limit)."""
    db = rt.db
    woken: list[Any] = []
    # Compensations run regardless of the limits; the throttle counts a run's first begin.
    throttle = None if compensate else workflow.throttle
    slots = None if compensate else workflow.concurrency
    with db.begin() as conn:
        # The run's row, and its keys' locks (throttle, then slot: every claim takes them in
        # that order), in one statement.
        run = flow_rows.lock_run_txn(db, conn, run_id, throttle is not None, slots is not None)
        if run is None:
            return None
        if run.throttle_key is None or run.started_at is not None:
            throttle = None
        if run.slot_key is None:
            slots = None
        if throttle is not None and _parked_by_throttle(rt, conn, throttle, run, step.index):
            return None
        if slots is not None and _parked_for_slot(rt, conn, slots, run, step.index, woken):
            row = None
        else:
            row = queries.claim_run(db, conn, run_id, step.index, node, workflow.timeout, compensate)
        if row is not None and run.flow_wait is not None:
            flow_rows.clear_wait_txn(db, conn, run_id)
    _send(rt, woken)
    return row


def _parked_by_throttle(
    rt: Runtime, conn: Connection, throttle: FlowLimit, run: Any, step_index: int
) -> bool:
    """True if the throttle's window (or the line ahead) keeps ``run`` from beginning now; it
    is then parked, due when it should look again."""
    until = _throttled_until(rt, conn, throttle, run)
    if until is None:
        return False
    if flow_rows.park_txn(rt.db, conn, run.id, step_index, THROTTLE, until) and run.flow_wait is None:
        details = {"key": run.throttle_key, "until": until.isoformat(), **_shown(throttle)}
        _note(rt, conn, run, "throttled", details)
    return True


def _parked_for_slot(
    rt: Runtime, conn: Connection, slots: FlowLimit, run: Any, step_index: int, woken: list[Any]
) -> bool:
    """True if every slot of ``run``'s key is in use or promised to runs started before it; it
    is then parked, and runs parked longer take any slot that is free (into ``woken``)."""
    used, ahead = flow_rows.slot_line_txn(rt.db, conn, run, slots.limit)
    if used + ahead < slots.limit:
        return False
    if flow_rows.park_txn(rt.db, conn, run.id, step_index, SLOT, None):
        if run.flow_wait is None:
            _note(rt, conn, run, "slot_wait", {"key": run.slot_key, "in_use": used, **_shown(slots)})
        woken.extend(_fill(rt, conn, run.workflow, run.slot_key, slots.limit))
    return True


def _throttled_until(rt: Runtime, conn: Connection, throttle: FlowLimit, run: Any) -> datetime | None:
    """None if ``run`` may begin now; else when it should look again: when the window frees
    the place it holds in the line (runs started before it go first)."""
    assert throttle.period is not None
    db, limit, period = rt.db, throttle.limit, throttle.period
    begun = flow_rows.begins_in_window_txn(db, conn, run.workflow, run.throttle_key, period, limit)
    ahead = flow_rows.throttle_line_ahead_txn(db, conn, run, min(LINE_BOUND, LINE_WINDOWS * limit))
    if len(begun) + ahead < limit:
        return None
    now = db.utcnow()
    # When each of the window's places frees, soonest first: the free ones now, the others
    # one period after the begin that holds them.
    frees = [now] * (limit - len(begun)) + [
        (aware(at) or now) + timedelta(seconds=period) for at in reversed(begun)
    ]
    place = ahead  # the runs ahead take the places that free before this run's
    until = frees[place % limit] + timedelta(seconds=period * (place // limit))
    if until <= now:  # its place is free, taken by runs ahead that may begin now: look again soon
        return now + timedelta(seconds=min(MIN_RECHECK, period))
    return until + timedelta(seconds=CLOCK_MARGIN if db.is_postgres else 0.0)  # SQLite: this clock


# -- slots coming free --------------------------------------------------------------------------


def settle_parked_start(rt: Runtime, workflow: str, slot_key: str) -> None:
    """After the commit of a start that parked its run: if the key has a slot neither in use
    nor promised (the line emptied while the start was deciding), fill it, as a release would.
    One read when the key is busy, as it almost always is."""
    known = rt.registry.workflows.get(workflow)
    limit = known.concurrency if known is not None else None
    if limit is None:
        return
    with rt.db.engine.connect() as conn:
        used, due = flow_rows.slot_use_txn(rt.db, conn, workflow, slot_key, limit.limit)
    if used + due < limit.limit:
        release(rt, known, slot_key)  # type: ignore[arg-type]


def release(rt: Runtime, workflow: Workflow, slot_key: str | None) -> None:
    """A step of a run with ``slot_key`` ended (or was handed back): wake the runs parked
    longest for the slots now free."""
    limit = workflow.concurrency
    if limit is None or slot_key is None:
        return
    with rt.db.begin() as conn:
        flow_rows.lock_key_txn(conn, SLOT, workflow.name or "", slot_key)
        woken = _fill(rt, conn, workflow.name or "", slot_key, limit.limit)
    _send(rt, woken)


class SlotWaker:
    """Upkeep: passes over the keys with runs parked for a slot, waking as many of each key's
    runs as it has free slots (a slot freed by a crashed worker, or a wake-up lost between
    commit and send). A pass looks at up to ``KEYS_PER_PASS`` keys, going on after the last key
    the pass before looked at (from the first again past the last): every key is looked at,
    however many there are. One statement reads the keys with their slots in use; only a key
    with a slot free when read is locked and filled (a pass over full keys costs that one read).
    Runs of a workflow defined here without a concurrency limit any more (a deploy removed it)
    are all woken; keys of workflows not defined here are left to the nodes that define them."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.after: tuple[str, str] | None = None  # the last key the last pass looked at

    def wake_slots_once(self) -> int:
        """One pass; returns how many runs it woke."""
        rt = self.rt
        limits = [w.concurrency.limit for w in rt.registry.workflows.values() if w.concurrency is not None]
        bound = max(limits, default=1)
        with rt.db.engine.connect() as conn:
            parked = flow_rows.parked_slot_keys(rt.db, conn, KEYS_PER_PASS, self.after, bound)
        self.after = (parked[-1][0], parked[-1][1]) if len(parked) == KEYS_PER_PASS else None
        woken = 0
        for name, slot_key, held, due in parked:
            workflow = rt.registry.workflows.get(name)
            if workflow is None:
                continue  # defined on other nodes only: theirs to wake
            if workflow.concurrency is not None and held + due >= workflow.concurrency.limit:
                continue  # every slot in use or promised when read: the step that frees one wakes
            with rt.db.begin() as conn:
                flow_rows.lock_key_txn(conn, SLOT, name, slot_key)
                if workflow.concurrency is None:
                    rows = flow_rows.wake_parked_txn(rt.db, conn, name, slot_key, LINE_BOUND)
                else:
                    rows = _fill(rt, conn, name, slot_key, workflow.concurrency.limit)
            _send(rt, rows)
            woken += len(rows)
        if woken:
            log.info("durable: woke %d run(s) parked for a concurrency slot", woken)
        return woken


def wake_slots_once(rt: Runtime) -> int:
    """One ``SlotWaker`` pass from the first key (eager mode, tests); returns the runs woken."""
    return SlotWaker(rt).wake_slots_once()


def _fill(rt: Runtime, conn: Connection, workflow: str, slot_key: str, limit: int) -> list[Any]:
    """Under the key's lock: wake the runs parked longest, as many as the slots neither in use
    nor promised to a run already due."""
    db = rt.db
    used, due = flow_rows.slot_use_txn(db, conn, workflow, slot_key, limit)
    free = limit - used - due
    return flow_rows.wake_parked_txn(db, conn, workflow, slot_key, free) if free > 0 else []


def _send(rt: Runtime, woken: list[Any]) -> None:
    """After commit: the woken runs' messages (the relay re-sends any this misses)."""
    for row in woken:
        rt.outbox.send_named(row.workflow, row.id, row.step_index, row.attempt, row.key, soon=True)


def _note(rt: Runtime, conn: Connection, run: Any, kind: str, details: dict[str, Any]) -> None:
    """An activity entry the first time a run is parked by its limit (not at every look)."""
    activity_rows.record_txn(rt.db, conn, kind, run.id, run.workflow, None, details)


def _shown(limit: FlowLimit) -> dict[str, Any]:
    """The limit's figures for an activity entry (its key template is the workflow's)."""
    return {"limit": limit.limit, **({"period": limit.period} if limit.period is not None else {})}
