"""Every statement that touches the database, each a named function.

Functions named ``*_txn`` run inside the caller's transaction (``conn``); the caller owns commit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    DateTime,
    Interval,
    Row,
    Text,
    and_,
    bindparam,
    case,
    cast,
    exists,
    func,
    insert,
    null,
    or_,
    select,
    text,
    update,
)

from . import direct
from .bounded import no_jit
from .db import Clock, Database, one_of, shape
from .queue_rows import paused_exists
from .schema import keys, queues, runs, steps

# A waiting run is claimable once due: its timeout passed or its event came.
CLAIMABLE = ("pending", "running", "waiting")
# A run a worker may hold: running a step, or running a compensation.
HELD = ("running", "compensating")
# Runs the relay sends messages for: claimable ones and compensating ones.
RELAYED = (*CLAIMABLE, "compensating")

# Columns a worker needs to run a step; returned by the claim itself, so a claim is one statement.
_CLAIM_COLUMNS = (
    runs.c.id,
    runs.c.workflow,
    runs.c.input,
    runs.c.context,
    runs.c.key,
    runs.c.step_index,
    runs.c.step_name,
    runs.c.attempt,
    runs.c.attempt_base,
    runs.c.fence,
    runs.c.parent_id,
    runs.c.losses,
    runs.c.wait_name,
    runs.c.trace_parent,
    runs.c.slot_key,  # the concurrency slot the step holds, freed when it ends (flow.py)
    runs.c.locked_by,  # with the fence, what every write of the holder checks (_held_run_update)
)

_HOLDS_KEY = select(keys.c.holder_id).where(keys.c.holder_id == runs.c.id).exists().label("holds_key")


def insert_run_txn(
    db: Database, conn: Connection, values: dict[str, Any], sent: Callable[[], None] | None = None
) -> None:
    """Insert one run row (Clock values are times on the database's clock).

    ``sent`` (PostgreSQL, a :meth:`Database.single` connection): called once the INSERT is on its
    way and before it commits (a start hands over its first step's message there). The INSERT
    holds the run's start lock until it commits, which a worker holding that message waits on
    (``await_start``) when it finds no run yet."""
    if sent is None:
        stmt, params = db.bind("insert_run", runs.c, values, lambda sv: insert(runs).values(**sv))
        direct.first(db, conn, stmt, params)
        return

    def build(sv: dict[str, Any]) -> Any:
        # pg_advisory_xact_lock gives void, which casts to '': the id is unchanged.
        return insert(runs).values(**{**sv, "id": sv["id"] + _start_lock(sv["id"], shared=False)})

    stmt, params = db.bind("insert_run_sent", runs.c, values, build)
    direct.first(db, conn, stmt, params, sent=sent)


def await_start(conn: Connection, run_id: str) -> None:
    """Wait until a start holding the run's start lock (``insert_run_txn`` with ``sent``) has
    committed or failed. On an autocommit connection the next statement sees what committed."""
    conn.execute(select(_start_lock(bindparam("p_id"), shared=True)), {"p_id": run_id})


# The first key of the start locks (two-key advisory locks; the second is the run id's hash).
START_LOCK = 0x64635354
_AWAIT_STARTS = text(
    "SELECT count(pg_advisory_xact_lock_shared(:lock, hashtext(id)))"
    " FROM unnest(CAST(:ids AS text[])) AS t(id)"
)


def _start_lock(run_id: Any, shared: bool) -> Any:
    lock = func.pg_advisory_xact_lock_shared if shared else func.pg_advisory_xact_lock
    return cast(lock(START_LOCK, func.hashtext(run_id)), Text)


def fetch_run(conn: Connection, run_id: str, lock: bool = False) -> Row[Any] | None:
    """One run row by id, or None; with ``lock``, the row stays locked until the transaction ends."""
    query = select(runs, _HOLDS_KEY).where(runs.c.id == run_id)
    return conn.execute(query.with_for_update(of=runs) if lock else query).first()


def fetch_runs(
    conn: Connection,
    *where: Any,
    parent_id: str | None = None,
    after: str | None = None,
    limit: int,
) -> Sequence[Any]:
    """Runs matching the conditions (store/run_filters.py) or children of ``parent_id``, newest
    first by their time-ordered id (the primary key's order: no sort of every run); ``after``:
    the page after the run with that id."""
    query = select(runs, _HOLDS_KEY).where(*where)
    if parent_id is not None:
        query = query.where(runs.c.parent_id == parent_id)
    if after is not None:
        query = query.where(runs.c.id < after)
    query = query.order_by(runs.c.id.desc()).limit(limit)
    return conn.execute(query).all()


def fetch_steps(
    conn: Connection, run_id: str, limit: int | None = None, after: int | None = None
) -> Sequence[Any]:
    """A run's recorded step attempts in order (by id), ``limit`` of them past the step ``after``."""
    query = select(steps).where(steps.c.run_id == run_id, *([] if after is None else [steps.c.id > after]))
    return conn.execute(query.order_by(steps.c.id).limit(limit)).all()


def claim_run(
    db: Database,
    conn: Connection,
    run_id: str,
    step_index: int,
    node: str,
    timeout: float | None = None,
    compensate: bool = False,
) -> Row[Any] | None:
    """Take the run for one step (or, with ``compensate``, one compensation) if it is due and
    unlocked; bumps the fencing token. A compensating run keeps its status.

    Every later write of the holder checks the fence and ``locked_by`` (``_held_run_update``):
    should the claim be lost while its worker runs the step (a failover to a standby that had
    not received it), a worker that takes the run again under the same fence number is never
    confused with the first.
    """

    def build() -> Any:
        now = db.clock_expression("p_now", Clock())
        # A workflow timeout counts from when the run is first due (debounced, or handed the
        # key by run_again), unless it was set at start.
        deadline: Any = runs.c.deadline_at
        if timeout:
            deadline = func.coalesce(runs.c.deadline_at, db.clock_expression("p_deadline", Clock(1)))
        statuses = ("compensating",) if compensate else CLAIMABLE
        return (
            update(runs)
            .where(
                runs.c.id == bindparam("p_id"),
                runs.c.step_index == bindparam("p_step"),
                one_of(runs.c.status, statuses),
                runs.c.locked_by.is_(None),
                # Not a condition the due index can serve: the run is found by its id. With
                # statistics that think few runs are due (a history of finished runs, then a
                # burst of starts), the planner would walk every due run for each claim.
                (runs.c.due_at <= now).is_(True),
                ~paused_exists(),  # a step of a paused queue waits for its resume (queues.py)
            )
            .values(
                status="compensating" if compensate else "running",
                fence=runs.c.fence + 1,
                locked_by=bindparam("p_node"),
                heartbeat_at=now,
                due_at=None,
                published=False,
                resends=0,
                resend_at=None,
                started_at=func.coalesce(runs.c.started_at, now),
                deadline_at=deadline,
            )
            .returning(*_CLAIM_COLUMNS)
        )

    clocks = {"p_now": Clock(), **({"p_deadline": Clock(timeout)} if timeout else {})}
    params = {"p_id": run_id, "p_step": step_index, "p_node": node, **db.clock_params(clocks)}
    return direct.first(db, conn, db.statement(("claim", bool(timeout), compensate), build), params)


def run_held_by(conn: Connection, run_id: str, node_prefix: str) -> Any:
    """The run, if a worker whose ``locked_by`` starts with ``node_prefix`` holds it."""
    query = select(*_CLAIM_COLUMNS, runs.c.status, runs.c.heartbeat_at).where(
        runs.c.id == run_id,
        runs.c.status.in_(HELD),
        runs.c.locked_by.startswith(node_prefix, autoescape=True),
    )
    return conn.execute(query).first()


def heartbeat_run(db: Database, conn: Connection, run_id: str, fence: int, holder: str) -> bool:
    """Refresh the lock of a running step; False when the run was cancelled or taken over."""

    def build() -> Any:
        now = db.clock_expression("p_now", Clock())
        return _held_run_update({"heartbeat_at": now})

    params = {"p_id": run_id, "p_fence": fence, "p_holder": holder, **db.clock_params({"p_now": Clock()})}
    return bool(conn.execute(db.statement("heartbeat", build), params).rowcount == 1)


_INSERT_STEP = insert(steps)


def _held_run_update(set_values: dict[str, Any]) -> Any:
    """An UPDATE of the run a worker holds, matching only under the fence it claimed with and
    while it holds the lock (``p_holder``, its ``locked_by``): a write tried again after its
    first try committed unanswered (an outage) matches nothing, and the worker finds its step
    row instead (engine._write); so does the write of a worker whose claim was lost (see
    ``claim_run``), even once another has taken the run under that fence."""
    return (
        update(runs)
        .where(
            runs.c.id == bindparam("p_id"),
            runs.c.fence == bindparam("p_fence"),
            one_of(runs.c.status, HELD),
            runs.c.locked_by == bindparam("p_holder"),
        )
        .values(**set_values)
    )


class GoOn:
    """Claim the run's next step for ``node`` in the statement that records this one (inline
    continuation, engine.py), unless the next step's ``queue`` is paused."""

    __slots__ = ("node", "queue")

    def __init__(self, node: str, queue: str) -> None:
        self.node, self.queue = node, queue


def _go_on_values(db: Database) -> dict[str, Any]:
    """SET expressions of an inline continuation: held by this worker under a new fence, or,
    when the next step's queue is paused, due with no message (the resume re-arms it)."""
    paused = exists().where(queues.c.name == bindparam("c_queue"), queues.c.paused.is_(True))
    now = db.clock_expression("c_now", Clock())
    return {
        "locked_by": case((paused, null()), else_=bindparam("c_node")),
        "heartbeat_at": case((paused, null()), else_=now),
        "due_at": case((paused, now), else_=null()),
        "fence": runs.c.fence + 1,
        "published": False,
        "resends": 0,
        "resend_at": None,
    }


def _go_on_params(db: Database, go_on: GoOn | None) -> dict[str, Any]:
    if go_on is None:
        return {}
    return {"c_node": go_on.node, "c_queue": go_on.queue, **db.clock_params({"c_now": Clock()})}


def _record_values(run_values: dict[str, Any]) -> dict[str, Any]:
    """The run's columns a record sets: unlocked, then ``run_values``. With a continuation,
    ``_go_on_values`` sets the lock and message columns again, last."""
    return {"locked_by": None, "heartbeat_at": None, **run_values}


def record_step_txn(
    db: Database,
    conn: Connection,
    run_id: str,
    fence: int,
    holder: str,
    run_values: dict[str, Any],
    step_row: dict[str, Any],
    go_on: GoOn | None = None,
) -> Row[Any] | None:
    """Write a step's outcome and the run's next state, unless the worker was fenced out
    (None); with ``go_on``, also claim the next step (the row has the claim's columns)."""
    values = _record_values(run_values)

    def build(set_values: dict[str, Any]) -> Any:
        if go_on is None:
            return _held_run_update(set_values).returning(runs.c.id)
        return _held_run_update({**set_values, **_go_on_values(db)}).returning(*_CLAIM_COLUMNS)

    stmt, params = db.bind(("record", go_on is None), runs.c, values, build)
    held = {"p_id": run_id, "p_fence": fence, "p_holder": holder}
    row = conn.execute(stmt, {**held, **params, **_go_on_params(db, go_on)}).first()
    if row is None:
        return None
    conn.execute(_INSERT_STEP, {"run_id": run_id, **step_row})
    return row


def record_step(
    db: Database,
    conn: Connection,
    run_id: str,
    fence: int,
    holder: str,
    run_values: dict[str, Any],
    step_row: dict[str, Any],
    go_on: GoOn | None = None,
) -> Row[Any] | None:
    """PostgreSQL only: :func:`record_step_txn` as one statement, for an autocommit connection."""
    values = _record_values(run_values)
    step_keys = tuple(step_row)

    def build() -> Any:
        set_values = db.set_values("r_", runs.c, values)
        if go_on is None:
            returned: tuple[Any, ...] = (runs.c.id,)
        else:
            set_values.update(_go_on_values(db))
            returned = _CLAIM_COLUMNS
        recorded = _held_run_update(set_values).returning(*returned).cte("recorded")
        step_values = db.set_values("s_", steps.c, step_row)
        chosen = select(recorded.c.id, *(step_values[k] for k in step_keys)).select_from(recorded)
        inserted = insert(steps).from_select(["run_id", *step_keys], chosen)
        if go_on is None:
            return inserted.returning(steps.c.id)
        return select(*recorded.c).add_cte(inserted.cte("inserted"))

    stmt = db.statement(("record_step", shape(values), step_keys, go_on is None), build)
    params = {
        "p_id": run_id,
        "p_fence": fence,
        "p_holder": holder,
        **db.values_params("r_", values),
        **db.values_params("s_", step_row),
        **_go_on_params(db, go_on),
    }
    return direct.first(db, conn, stmt, params)


def step_recorded(
    conn: Connection, run_id: str, step_index: int, phase: str, attempt: int, worker: str
) -> bool:
    """Whether ``worker`` recorded this attempt of the step (or compensation) of the run."""
    query = select(steps.c.id).where(
        steps.c.run_id == run_id,
        steps.c.step_index == step_index,
        steps.c.phase == phase,
        steps.c.attempt == attempt,
        steps.c.worker == worker,
    )
    return conn.execute(query.limit(1)).first() is not None


def hand_back_txn(
    db: Database, conn: Connection, run_id: str, fence: int, holder: str, seconds: float
) -> bool:
    """Give up a held run without recording a step: due again in ``seconds``, same attempt."""
    values = {"locked_by": None, "heartbeat_at": None, "due_at": Clock(seconds), "published": False}
    stmt, params = db.bind("hand_back", runs.c, values, _held_run_update)
    held = {"p_id": run_id, "p_fence": fence, "p_holder": holder}
    return bool(conn.execute(stmt, {**held, **params}).rowcount == 1)


def pending_inputs(conn: Connection, prefix: str, limit: int, workflow: str | None) -> Sequence[Any]:
    """Runs (of ``workflow``, if given) waiting for an input, oldest first."""
    query = (
        select(runs.c.id, runs.c.workflow, runs.c.wait_name, runs.c.wait_until, runs.c.key)
        .where(runs.c.status == "waiting", runs.c.wait_name.startswith(prefix, autoescape=True))
        .order_by(runs.c.created_at, runs.c.id)
        .limit(limit)
    )
    if workflow is not None:
        query = query.where(runs.c.workflow == workflow)
    return conn.execute(query).all()


def cancel_run_txn(
    db: Database, conn: Connection, run_id: str, error: dict[str, Any], statuses: Sequence[str]
) -> bool:
    """Mark an unfinished run cancelled; False when its status was not one given."""
    query = (
        update(runs)
        .where(runs.c.id == run_id, runs.c.status.in_(list(statuses)))
        .values(
            status="cancelled",
            error=error,
            finished_at=db.now(),
            due_at=None,
            published=False,
            locked_by=None,
        )
    )
    return bool(conn.execute(query).rowcount == 1)


def _of_known(known: Sequence[str]) -> tuple[Any, Any]:
    """Runs of workflows this process knows, in queues that are not paused (theirs wait)."""
    return runs.c.workflow.in_(known), ~paused_exists()


def relay_candidates(
    db: Database, conn: Connection, relay_after: float, known: Sequence[str]
) -> Sequence[Any]:
    """Per queue with a run due for a re-send: how many of its runs (of ``known`` workflows,
    in queues not paused) are sent and unclaimed."""
    sent = and_(runs.c.published.is_(True), runs.c.locked_by.is_(None), runs.c.due_at <= db.now())
    query = (
        select(runs.c.queue, func.count().label("unclaimed"))
        .where(sent, runs.c.status.in_(RELAYED), *_of_known(known))
        .group_by(runs.c.queue)
        .having(func.max(case((_resend_due(db, relay_after), 1), else_=0)) == 1)
    )
    no_jit(conn)  # the relay's pass, every poll_interval on every worker
    return conn.execute(query).all()


def _resend_due(db: Database, relay_after: float) -> Any:
    """A sent run's re-send is due: ``relay_after`` after it became due, then when the relay
    said it would look again."""
    first = and_(runs.c.resend_at.is_(None), runs.c.due_at <= db.later(-relay_after))
    return and_(runs.c.published.is_(True), or_(first, runs.c.resend_at <= db.now()))


def take_due_runs_txn(
    db: Database, conn: Connection, relay_after: float, limit: int, known: Sequence[str]
) -> Sequence[Any]:
    """Runs of ``known`` workflows in queues not paused needing a message: due and never sent,
    or sent and due for a re-send (``resend`` tells which). Rows other nodes hold are skipped;
    the caller marks what it did with :func:`mark_relayed_txn` in the same transaction."""
    due = and_(runs.c.due_at.is_not(None), runs.c.locked_by.is_(None))
    never_sent = and_(runs.c.published.is_(False), runs.c.due_at <= db.now())
    query = (
        select(
            runs.c.id,
            runs.c.workflow,
            runs.c.step_index,
            runs.c.step_name,
            runs.c.attempt,
            runs.c.key,
            runs.c.status,
            runs.c.queue,
            runs.c.resends,
            runs.c.published.label("resend"),
        )
        .where(
            due, or_(never_sent, _resend_due(db, relay_after)), runs.c.status.in_(RELAYED), *_of_known(known)
        )
        .order_by(runs.c.due_at, runs.c.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    no_jit(conn)  # the relay's pass, every poll_interval on every worker
    return conn.execute(query).all()


def mark_relayed_txn(db: Database, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Mark runs sent (or looked at) by the relay: ``{"b_id", "b_resends", "b_after"}`` each,
    the relay looking again ``b_after`` seconds from now unless a worker claims the run."""
    if not rows:
        return
    if db.is_postgres:
        resend_at: Any = func.now() + bindparam("b_after", type_=Interval())
        params = [{**r, "b_after": timedelta(seconds=r["b_after"])} for r in rows]
    else:
        resend_at = bindparam("b_at", type_=DateTime(timezone=True))
        now = db.utcnow()
        params = [{**r, "b_at": now + timedelta(seconds=r["b_after"])} for r in rows]
    query = (
        update(runs)
        .where(runs.c.id == bindparam("b_id"))
        .values(published=True, resends=bindparam("b_resends"), resend_at=resend_at)
    )
    conn.execute(query, params)


def mark_unsent(conn: Connection, run_ids: Sequence[str], after_starts: bool = False) -> None:
    """Flag runs whose message could not be sent, so the relay sends it at its next pass.

    ``after_starts`` (the publisher's refusals): first wait for the starts of these runs that
    may not have committed yet (a start sends its message ahead, ``insert_run_txn``), so that the
    flag is not lost on a row this statement could not see yet."""
    if after_starts and conn.dialect.name == "postgresql":
        conn.execute(_AWAIT_STARTS, {"lock": START_LOCK, "ids": list(run_ids)})
    conn.execute(
        update(runs).where(runs.c.id.in_(list(run_ids)), runs.c.published.is_(True)).values(published=False)
    )


def run_hold(conn: Connection, run_id: str) -> Any:
    """The fencing token and ``locked_by`` of one run, or None when there is no such run."""
    return conn.execute(select(runs.c.fence, runs.c.locked_by).where(runs.c.id == run_id)).first()


def count_runs_by_status(conn: Connection) -> dict[tuple[str, str], int]:
    """How many runs each workflow has in each status."""
    query = select(runs.c.workflow, runs.c.status, func.count()).group_by(runs.c.workflow, runs.c.status)
    return {(w, s): n for w, s, n in conn.execute(query)}


def defer_unclaimed_txn(db: Database, conn: Connection, run_id: str, step_index: int, seconds: float) -> bool:
    """A worker lacks the run's code: make the run due again in ``seconds``, unsent."""
    query = (
        update(runs)
        .where(
            runs.c.id == run_id,
            runs.c.step_index == step_index,
            runs.c.status.in_(CLAIMABLE),
            runs.c.locked_by.is_(None),
        )
        .values(due_at=db.later(seconds), published=False)
    )
    return bool(conn.execute(query).rowcount == 1)


def fail_unclaimed_txn(
    db: Database, conn: Connection, run_id: str, step_index: int, error: dict[str, Any]
) -> bool:
    """Fail a run that no worker holds, at step ``step_index`` (its step is gone)."""
    query = (
        update(runs)
        .where(
            runs.c.id == run_id,
            runs.c.step_index == step_index,
            runs.c.status.in_(CLAIMABLE),
            runs.c.locked_by.is_(None),
        )
        .values(status="failed", error=error, finished_at=db.now(), due_at=None, published=False)
    )
    return bool(conn.execute(query).rowcount == 1)


def due_now(
    db: Database, conn: Connection, limit: int, known: Sequence[str], only: Collection[str] | None = None
) -> Sequence[Any]:
    """Unlocked runs of ``known`` workflows due now in a queue that is not paused, oldest due
    first (with ``only``: those runs and their children): what a step runner in the calling
    thread (testing.Fake, eager mode) takes next."""
    where = () if only is None else (or_(runs.c.id.in_(only), runs.c.parent_id.in_(only)),)
    query = (
        select(runs.c.id, runs.c.workflow, runs.c.step_index, runs.c.status)
        .where(
            runs.c.due_at <= db.now(),
            runs.c.locked_by.is_(None),
            runs.c.status.in_(RELAYED),
            *_of_known(known),
            *where,
        )
        .order_by(runs.c.due_at, runs.c.id)
        .limit(limit)
    )
    return conn.execute(query).all()
