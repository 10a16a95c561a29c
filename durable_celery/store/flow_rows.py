"""Statements of flow control (core/flow.py): a key's lock, its slots and line, its throttle and
rate-limit windows, parking and waking runs (the reads for people are in flow_reads.py).

Every count is bounded (``LIMIT``) by what the decision needs, over a partial index of the key's
runs: a claim costs the same with 10 or 10,000 runs waiting behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    DateTime,
    Text,
    and_,
    bindparam,
    case,
    cast,
    func,
    literal,
    literal_column,
    or_,
    select,
    text,
    tuple_,
    update,
)

from .bounded import no_jit
from .db import Clock, Database
from .queries import CLAIMABLE
from .queue_rows import paused_exists
from .schema import runs

SLOT = "slot"
THROTTLE = "throttle"
# Columns a woken run's message needs.
_WOKEN = (runs.c.id, runs.c.workflow, runs.c.step_index, runs.c.attempt, runs.c.key)
_TIME = DateTime(timezone=True)

# Constants are written into the SQL, not bound: a prepared statement's generic plan can use a
# partial index whose condition names them (flow_wait = 'slot') only if the query names them too.
_SLOT_SQL: Any = literal_column(f"'{SLOT}'")
_THROTTLE_SQL: Any = literal_column(f"'{THROTTLE}'")
_RUNNING_SQL: Any = literal_column("'running'")


def _claimable() -> Any:
    return runs.c.status.in_([literal_column(f"'{status}'") for status in CLAIMABLE])


# Each statement is built once per Database (``db.statement``) and bound per call: a claim under
# a limit makes several, and building them would cost more than running them. A statement is
# cached under the name of the function that builds it (each is nested in the function it
# serves, so the names differ).


def _execute(
    db: Database,
    conn: Connection,
    build: Callable[[], Any],
    params: dict[str, Any],
    named_by: Callable[[], Any] | None = None,
) -> Any:
    """Run ``build()``'s statement with ``params``; it is cached under ``build``'s name, or under
    ``named_by``'s (the builder ``build`` wraps)."""
    clocks = {n: v for n, v in params.items() if isinstance(v, Clock)}
    values = {n: v for n, v in params.items() if not isinstance(v, Clock)} | db.clock_params(clocks)
    return conn.execute(db.statement(("flow", (named_by or build).__qualname__), build), values)


def _counted(where: list[Any]) -> Any:
    """SQL: how many rows match ``where``, counting at most ``p_bound``. A count of the runs
    ahead of one in line (``_before``) reads them in line order: so a plan made for any values (a
    prepared statement's generic plan) walks the key's index in line order and stops at the
    run, rather than scanning the table expecting to meet ``p_bound`` matches early."""
    inner = select(runs.c.id).where(*where)
    if any(getattr(condition, "_durable_before", False) for condition in where):
        inner = inner.order_by(runs.c.line_at)
    inner_query = inner.limit(bindparam("p_bound")).subquery()
    return select(func.count()).select_from(inner_query).correlate(None).scalar_subquery()


def _counts(db: Database, conn: Connection, build: Callable[[], list[Any]], params: dict[str, Any]) -> Any:
    """Several bounded counts (``build()``: one list of conditions each) in one statement."""
    counted = _execute(db, conn, lambda: select(*(_counted(where) for where in build())), params, build)
    return counted.one()


def lock_key_txn(conn: Connection, kind: str, workflow: str, key: str) -> None:
    """Serialise the decisions of one flow key until the transaction ends: on PostgreSQL a
    transaction-level advisory lock on the key's hash (two keys sharing a hash only wait on
    each other); SQLite's one writer already serialises them."""
    if conn.dialect.name != "postgresql":
        return
    conn.execute(_LOCK, {"scope": f"durable:{kind}:{workflow}:{key}"})


_LOCK = text("SELECT pg_advisory_xact_lock(hashtextextended(:scope, 0))")


def lock_run_txn(db: Database, conn: Connection, run_id: str, throttle: bool, slot: bool) -> Any:
    """The run's flow columns and start order, or None. On PostgreSQL the same statement takes
    the locks (``lock_key_txn``'s) of its throttle key, if ``throttle`` and it has not begun,
    then of its slot key, if ``slot``."""

    def build() -> Any:
        columns = ("id", "workflow", "slot_key", "throttle_key", "started_at", "line_at", "flow_wait")
        found: list[Any] = [runs.c[c] for c in columns]
        if db.is_postgres:
            for kind, column, when in (
                (THROTTLE, "throttle_key", and_(bindparam("p_throttle"), runs.c.started_at.is_(None))),
                (SLOT, "slot_key", bindparam("p_slot")),
            ):
                scope = literal(f"durable:{kind}:") + runs.c.workflow + literal(":") + runs.c[column]
                lock = cast(func.pg_advisory_xact_lock(func.hashtextextended(scope, 0)), Text)
                found.append(case((and_(when, runs.c[column].is_not(None)), lock)).label(f"{kind}_lock"))
        return select(*found).where(runs.c.id == bindparam("p_id"))

    params = {"p_id": run_id, "p_throttle": throttle, "p_slot": slot}
    return _execute(db, conn, build, params).first()


def _before() -> list[Any]:
    """Ahead in line of the run ``p_id`` lined up at ``p_line`` (line order: line_at, then id;
    without priorities or fair keys, start order)."""
    line: Any = bindparam("p_line", type_=_TIME)
    run_id: Any = bindparam("p_id")
    bound = runs.c.line_at <= line
    bound._durable_before = True  # type: ignore[attr-defined]  # read by _counted
    return [bound, or_(runs.c.line_at < line, runs.c.id < run_id), runs.c.id != run_id]


# The conditions below repeat those of the partial indexes (schema.FLOW_INDEX_SPECS), so the
# planner uses them.


def _of_key(column: str) -> list[Any]:
    return [runs.c.workflow == bindparam("p_wf"), runs.c[column] == bindparam("p_key")]


def _slot_held(of_key: list[Any] | None = None) -> list[Any]:
    """Steps of the key (``of_key``, else the bound one) executing (a compensation holds no slot)."""
    key = _of_key("slot_key") if of_key is None else of_key
    return [*key, runs.c.locked_by.is_not(None), runs.c.status == _RUNNING_SQL]


def _slot_idle(db: Database, of_key: list[Any] | None = None) -> list[Any]:
    """Unparked runs of the key (``of_key``, else the bound one) due for a step and not running:
    their messages are on the way."""
    return [
        *(_of_key("slot_key") if of_key is None else of_key),
        runs.c.flow_wait.is_(None),
        runs.c.locked_by.is_(None),
        runs.c.finished_at.is_(None),
        _claimable(),
        runs.c.due_at <= db.clock_expression("p_now", Clock()),
    ]


def _ahead_of_parked(workflow: Any, key: Any) -> Any:
    """Lined up no later than the first run parked for a slot of the key: a due run a free
    slot is promised to (one woken, or back from a sleep), not a new run behind the line, whose
    claim would park it (counting those would wake nobody while the broker's queue drains)."""
    head = runs.alias("head_of_line")
    first = (
        select(head.c.line_at)
        .where(
            head.c.workflow == workflow,
            head.c.slot_key == key,
            head.c.flow_wait == _SLOT_SQL,
            head.c.finished_at.is_(None),
        )
        .order_by(head.c.line_at)  # the first entry of ix_durable_runs_slot_parked_line
        .limit(1)
        .scalar_subquery()
    )
    return runs.c.line_at <= first


def _slot_parked() -> list[Any]:
    return [*_of_key("slot_key"), runs.c.flow_wait == _SLOT_SQL, runs.c.finished_at.is_(None)]


def _key(workflow: str, key: str, bound: int, **more: Any) -> dict[str, Any]:
    return {"p_wf": workflow, "p_key": key, "p_bound": bound, **more}


def slot_line_txn(db: Database, conn: Connection, run: Any, bound: int) -> tuple[int, int]:
    """For ``run``'s slot key: steps holding a slot, and runs ahead of ``run`` in line that wait
    for one (parked, or due and not yet claimed), each counted up to ``bound``."""

    def build() -> list[list[Any]]:
        return [_slot_held(), [*_slot_parked(), *_before()], [*_slot_idle(db), *_before()]]

    params = _key(run.workflow, run.slot_key, bound, p_line=run.line_at, p_id=run.id, p_now=Clock())
    held, parked, due = _counts(db, conn, build, params)
    return int(held), int(parked) + int(due)


def slot_use_txn(db: Database, conn: Connection, workflow: str, key: str, bound: int) -> tuple[int, int]:
    """For a slot key: steps holding a slot, and runs due for a step, not parked and ahead of
    the parked ones in line (their messages are on the way: they take free slots before any
    parked run is woken), each counted up to ``bound``."""

    def build() -> list[list[Any]]:
        ahead = _ahead_of_parked(bindparam("p_wf"), bindparam("p_key"))
        return [_slot_held(), [*_slot_idle(db), ahead]]

    params = _key(workflow, key, bound, p_now=Clock())
    held, due = _counts(db, conn, build, params)
    return int(held), int(due)


def wake_parked_txn(db: Database, conn: Connection, workflow: str, key: str, count: int) -> list[Any]:
    """Make the ``count`` runs first in line of those parked for a slot of the key due now
    (their messages are sent after commit); returns them."""

    def oldest() -> Any:
        return (
            select(runs.c.id)
            .where(*_slot_parked())
            .order_by(runs.c.line_at, runs.c.id)
            .limit(bindparam("p_bound"))
        )

    ids = [row.id for row in _execute(db, conn, oldest, _key(workflow, key, count))]
    if not ids:
        return []
    # Under the key's lock (or SQLite's one writer) nothing else wakes them in between.
    query = (
        update(runs)
        .where(runs.c.id.in_(ids))
        .values(flow_wait=None, due_at=db.now(), published=True, resends=0, resend_at=None)
        .returning(*_WOKEN)
    )
    return list(conn.execute(query).all())


def fair_line_txn(
    db: Database, conn: Connection, workflow: str, slot_key: str, fair_key: str, bound: int
) -> Any:
    """For a new run of a slot key (one statement, index probes only): ``head``, the first place
    in line of the key's parked runs; ``tail``, the last place of ``fair_key``'s unfinished runs
    (each None if there are none); ``held`` and ``due``, ``slot_use_txn``'s counts (every due
    run, up to ``bound``); and ``now`` on the database's clock."""

    def build() -> Any:
        head = select(runs.c.line_at).where(*_slot_parked()).order_by(runs.c.line_at).limit(1)
        tail = (
            select(runs.c.line_at)
            .where(
                *_of_key("slot_key"),
                runs.c.fair_key.is_not(None),
                runs.c.fair_key == bindparam("p_fair"),
                runs.c.finished_at.is_(None),
            )
            .order_by(runs.c.line_at.desc())
            .limit(1)
        )
        return select(
            head.scalar_subquery().label("head"),
            tail.scalar_subquery().label("tail"),
            _counted(_slot_held()).label("held"),
            _counted(_slot_idle(db)).label("due"),
            db.clock_expression("p_now", Clock()).label("now"),
        )

    params = _key(workflow, slot_key, bound, p_fair=fair_key, p_now=Clock())
    return _execute(db, conn, build, params).one()


def park_txn(db: Database, conn: Connection, run_id: str, step_index: int, kind: str, until: Any) -> bool:
    """Park a run the claim would have taken but for its flow limit: for a slot (``until``
    None: a freed slot wakes it) or for the throttle window (due again at ``until``)."""

    def build() -> Any:
        return (
            update(runs)
            .where(
                runs.c.id == bindparam("p_id"),
                runs.c.step_index == bindparam("p_step"),
                runs.c.status.in_(CLAIMABLE),
                runs.c.locked_by.is_(None),
                runs.c.due_at <= db.clock_expression("p_now", Clock()),
                ~paused_exists(),
            )
            .values(
                flow_wait=bindparam("p_kind"),
                due_at=bindparam("p_until", type_=_TIME),
                published=False,  # whatever sends it next sets resends and resend_at afresh
            )
        )

    params = {"p_id": run_id, "p_step": step_index, "p_kind": kind, "p_until": until, "p_now": Clock()}
    return bool(_execute(db, conn, build, params).rowcount == 1)


def clear_wait_txn(db: Database, conn: Connection, run_id: str) -> None:
    """The run was claimed: it waits for nothing of flow control any more."""

    def build() -> Any:
        return update(runs).where(runs.c.id == bindparam("p_id")).values(flow_wait=None)

    _execute(db, conn, build, {"p_id": run_id})


def _newest(db: Database, column: str, key_column: str, nth: bool = False) -> Any:
    """The key's ``column`` times after ``p_since``, newest first: at most ``p_bound`` of them,
    or (``nth``) only the ``p_bound``-th newest."""
    query = (
        select(runs.c[column])
        .where(
            *_of_key(key_column),  # with the comparison below: the partial index's IS NOT NULLs
            runs.c[column] > db.clock_expression("p_since", Clock(-1)),
        )
        .order_by(runs.c[column].desc())
    )
    if nth:
        return query.offset(bindparam("p_bound") - 1).limit(1)
    return query.limit(bindparam("p_bound"))


def begins_in_window_txn(
    db: Database, conn: Connection, workflow: str, key: str, period: float, limit: int
) -> list[datetime]:
    """When the key's runs began in the last ``period`` seconds, newest first, at most ``limit``."""
    params = _key(workflow, key, limit, p_since=Clock(-period))
    build = lambda: _newest(db, "started_at", "throttle_key")  # noqa: E731
    return [row[0] for row in _execute(db, conn, build, params)]


def throttle_line_ahead_txn(db: Database, conn: Connection, run: Any, bound: int) -> int:
    """Runs of ``run``'s throttle key not yet begun, ahead of it in line and waiting to begin
    (parked by the throttle, or due now), up to ``bound``."""

    def build() -> list[list[Any]]:
        return [
            [
                *_of_key("throttle_key"),
                runs.c.started_at.is_(None),
                runs.c.finished_at.is_(None),
                runs.c.locked_by.is_(None),
                _claimable(),
                or_(
                    runs.c.flow_wait == _THROTTLE_SQL, runs.c.due_at <= db.clock_expression("p_now", Clock())
                ),
                *_before(),
            ]
        ]

    params = _key(run.workflow, run.throttle_key, bound, p_line=run.line_at, p_id=run.id, p_now=Clock())
    return int(_counts(db, conn, build, params)[0])


def window_full_since_txn(
    db: Database, conn: Connection, workflow: str, key: str, period: float, limit: int
) -> datetime | None:
    """If the key's runs were started ``limit`` times in the last ``period`` seconds: the
    ``limit``-th newest start (the window frees a place ``period`` after it); else None."""
    params = _key(workflow, key, limit, p_since=Clock(-period))
    build = lambda: _newest(db, "created_at", "rate_key", nth=True)  # noqa: E731
    found = _execute(db, conn, build, params).first()
    return None if found is None else found[0]


def parked_slot_keys(
    db: Database, conn: Connection, limit: int, after: tuple[str, str] | None, bound: int
) -> Sequence[Any]:
    """Up to ``limit`` (workflow, slot_key, held, due) rows, in order after the pair ``after`` if
    given: the keys with runs parked for a slot, each with ``slot_use_txn``'s two counts (up to
    ``bound``), read in this one statement without the keys' locks."""
    pair = (runs.c.workflow, runs.c.slot_key)
    query = select(*pair).where(runs.c.flow_wait == _SLOT_SQL, runs.c.finished_at.is_(None))
    if after is not None:
        query = query.where(tuple_(*pair) > tuple_(literal(after[0]), literal(after[1])))
    parked = query.group_by(*pair).order_by(*pair).limit(limit).subquery("parked")
    of_parked = [runs.c.workflow == parked.c.workflow, runs.c.slot_key == parked.c.slot_key]

    def counted(where: list[Any]) -> Any:
        some = select(runs.c.id).where(*where).limit(bound).subquery()
        return select(func.count()).select_from(some).scalar_subquery()

    due = [*_slot_idle(db, of_parked), _ahead_of_parked(parked.c.workflow, parked.c.slot_key)]
    counts = (counted(_slot_held(of_parked)).label("held"), counted(due).label("due"))
    no_jit(conn)  # the upkeep's flow pass, on every worker
    rows = select(parked.c.workflow, parked.c.slot_key, *counts).order_by(*parked.c)
    return conn.execute(rows, db.clock_params({"p_now": Clock()})).all()
