"""The key decision: who holds a workflow key, and what a start with a held key gets.

Everything here runs inside one transaction and follows one lock order, so two transactions
never wait on each other in a circle: **the key row first, then run rows**.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from .. import signals
from ..definition import SendEvent, Workflow
from ..errors import DurableError, KeyContended, KeyTaken
from ..inputs import same_json
from ..store import activity_rows, child_rows, event_rows, key_rows, queries
from ..store.schema import UNFINISHED
from . import batches
from .flow import admit_start_txn, limited, starts_in_transaction

if TYPE_CHECKING:
    from .runtime import Runtime

MAX_HANDS = 3
# (workflow, run id, step index, attempt, key): a message to send once committed.
Dispatch = tuple[str, str, int, int, "str | None"]
FAILED_LIKE = ("failed", "cancelled", "compensated", "compensation_failed")
# A duplicate start's dropped input is kept whole in its key_duplicate entry up to this many
# bytes of JSON; past it, a digest, its size and a preview (the log is kept for a week).
DROPPED_INPUT_KEPT = 4096
DROPPED_INPUT_PREVIEW = 512


def reuse_frees(reuse: str, holder_status: str) -> bool:
    """Does ``reuse`` let a new run take the key from a holder in this status?"""
    if holder_status in UNFINISHED or reuse == "never":
        return False
    return reuse == "after_close" or holder_status in FAILED_LIKE


@dataclass
class Decision:
    """What a start came to: the id it returns and what to do once the transaction commits
    (``control.after_commit``)."""

    run_id: str
    created: bool = False
    publish: list[Dispatch] = field(default_factory=list)
    error: DurableError | None = None
    notices: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    # Runs this start cancelled (cancel_existing): their unfinished children go next.
    cancel_children: list[str] = field(default_factory=list)
    # (workflow, slot key) of a run parked at its start: checked once committed (flow.py).
    parked: list[tuple[str, str]] = field(default_factory=list)


class KeyDecision:
    """One keyed start inside a transaction (``conn``)."""

    def __init__(
        self,
        rt: Runtime,
        conn: Connection,
        workflow: Workflow,
        run: dict[str, Any],
        policy: str | SendEvent,
        fold: bool = True,
    ) -> None:
        self.rt, self.db, self.conn = rt, rt.db, conn
        self.workflow, self.run, self.policy = workflow, run, policy
        # A debounced workflow folds a start into its unclaimed holder; a rerun never does.
        self.fold = fold
        self.name: str = workflow.name or ""
        self.key: str = run["key"]

    def decide(self, key_seen_held: bool = False) -> Decision:
        """Take the key, or answer from its holder by reuse, debounce and on_duplicate.

        ``key_seen_held``: a moment ago the key had a row, so look at its holder first.
        """
        for hand in range(MAX_HANDS):
            skip_claim = key_seen_held and hand == 0
            if not skip_claim and key_rows.claim_key_txn(
                self.db, self.conn, self.name, self.key, self.run["id"]
            ):
                return self._insert_new()
            holder = key_rows.lock_key_txn(self.db, self.conn, self.name, self.key)
            if holder is not None:
                return self._duplicate(holder)
            # The key row changed hands, or it names a run that no longer exists (on PostgreSQL
            # a trigger deletes it with its run; a session with triggers off would not): such a
            # row holds nothing, so it goes.
            key_rows.drop_orphan_key_txn(self.conn, self.name, self.key)
        raise KeyContended(f"key {self.key!r} of {self.name!r} changed hands {MAX_HANDS} times")

    # -- outcomes ---------------------------------------------------------------------------

    def _insert_new(self, **changes: Any) -> Decision:
        run = {**self.run, **changes}
        admit_start_txn(self.rt, self.conn, self.workflow, run)  # RateLimited past its rate_limit
        queries.insert_run_txn(self.db, self.conn, run)
        publish: list[Dispatch] = [(self.name, run["id"], 0, 1, self.key)] if run["published"] else []
        return Decision(run["id"], created=True, publish=publish, parked=_parked_at_start(run))

    def _duplicate(self, holder: Any) -> Decision:
        if holder.status not in UNFINISHED:
            if reuse_frees(self.workflow.reuse, holder.status):
                return self._hand_off(holder)
            if self.policy == "use_existing":
                return self._answer(holder, "use_existing")
            return self._refuse(holder)
        unclaimed = holder.status == "pending" and holder.started_at is None
        if self.fold and self.workflow.debounce and unclaimed and self._take_input(holder, debounce=True):
            return self._answer(holder, "debounced")
        if isinstance(self.policy, SendEvent):
            return self._send_event(holder, self.policy.name)
        if self.policy == "use_existing":
            return self._answer(holder, "use_existing")
        if self.policy == "cancel_existing":
            if holder.status == "compensating":
                return self._refuse(holder)
            return self._hand_off(holder)
        if self.policy == "run_again":
            return self._run_again(holder, unclaimed)
        return self._refuse(holder)

    def _answer(self, holder: Any, outcome: str, **details: Any) -> Decision:
        self._record_duplicate(holder, outcome, **details)
        return Decision(holder.holder_id, notices=[self._dup_notice(holder, outcome)])

    def _refuse(self, holder: Any) -> Decision:
        self._record_duplicate(holder, "error")
        changed = not same_json(holder.input, self.run["input"])
        return Decision(
            holder.holder_id,
            error=KeyTaken(holder.holder_id, input_changed=changed, holder_status=holder.status),
            notices=[self._dup_notice(holder, "error")],
        )

    def _hand_off(self, holder: Any) -> Decision:
        """The new run takes the key from a finished holder, or replaces an unfinished one."""
        new_id = self.run["id"]
        decision = self._insert_new()
        if holder.status in UNFINISHED:  # cancel_existing
            reason = {
                "type": "Cancelled",
                "message": f"replaced by run {new_id}",
                "replaced_by": new_id,
                "traceback": None,
            }
            queries.cancel_run_txn(self.db, self.conn, holder.holder_id, reason, UNFINISHED)
            decision.cancel_children.append(holder.holder_id)
            wake_parent_txn(self.rt, self.conn, holder.holder_id, decision)
            if holder.waiting_id:
                queries.cancel_run_txn(self.db, self.conn, holder.waiting_id, reason, UNFINISHED)
                decision.notices.append(
                    (
                        signals.run_finished,
                        {"run_id": holder.waiting_id, "workflow": self.name, "status": "cancelled"},
                    )
                )
            self._record_duplicate(holder, "cancel_existing", replaced_by=new_id)
            decision.notices.append(self._dup_notice(holder, "cancel_existing"))
            decision.notices.append(
                (
                    signals.run_finished,
                    {"run_id": holder.holder_id, "workflow": self.name, "status": "cancelled"},
                )
            )
        key_rows.hand_key_txn(self.db, self.conn, self.name, self.key, new_id)
        activity_rows.record_txn(
            self.db,
            self.conn,
            "key_handed_off",
            new_id,
            self.name,
            self.key,
            {"from": holder.holder_id, "from_status": holder.status},
        )
        decision.notices.append(
            (
                signals.key_handoff,
                {"run_id": new_id, "workflow": self.name, "key": self.key, "previous_id": holder.holder_id},
            )
        )
        return decision

    def _run_again(self, holder: Any, unclaimed: bool) -> Decision:
        if unclaimed and self._take_input(holder, debounce=False):
            return self._answer(holder, "run_again")
        if holder.waiting_id is not None:
            key_rows.give_input_txn(self.conn, holder.waiting_id, self.run["input"])
            decision = self._answer(holder, "run_again", runs_after=holder.waiting_id)
            decision.run_id = holder.waiting_id
            return decision
        # It has no timeout yet: that counts from when it takes the key (at its first claim).
        waiting = self._insert_new(
            status="waiting",
            due_at=None,
            published=False,
            runs_after_id=holder.holder_id,
            deadline_at=None,
        )
        key_rows.set_waiting_txn(self.conn, self.name, self.key, waiting.run_id)
        self._record_duplicate(holder, "run_again", runs_after=waiting.run_id)
        waiting.notices.append(self._dup_notice(holder, "run_again"))
        return waiting

    def _send_event(self, holder: Any, name: str) -> Decision:
        event_rows.insert_event_txn(self.db, self.conn, holder.holder_id, name, self.run["input"])
        woken = event_rows.wake_if_waiting_txn(self.db, self.conn, holder.holder_id, name)
        decision = self._answer(holder, "send_event", event=name)
        if woken is not None:
            decision.publish.append(tuple(woken))  # type: ignore[arg-type]
        return decision

    def _take_input(self, holder: Any, *, debounce: bool) -> bool:
        """Give an unclaimed holder the newer input (restarting a debounce); False if claimed."""
        period = self.workflow.debounce["period"] if debounce and self.workflow.debounce else None
        return key_rows.take_input_txn(self.db, self.conn, holder.holder_id, self.run["input"], period)

    # -- records ----------------------------------------------------------------------------

    def _record_duplicate(self, holder: Any, outcome: str, **details: Any) -> None:
        policy = self.policy if isinstance(self.policy, str) else f"send_event:{self.policy.name}"
        activity_rows.record_txn(
            self.db,
            self.conn,
            "key_duplicate",
            holder.holder_id,
            self.name,
            self.key,
            {
                "outcome": outcome,
                "policy": policy,
                "input_changed": not same_json(holder.input, self.run["input"]),
                **dropped_input(self.run["input"]),
                "holder_status": holder.status,
                **details,
            },
        )

    def _dup_notice(self, holder: Any, outcome: str) -> tuple[Any, dict[str, Any]]:
        return (
            signals.key_duplicate,
            {"run_id": holder.holder_id, "workflow": self.name, "key": self.key, "outcome": outcome},
        )


def dropped_input(data: dict[str, Any]) -> dict[str, Any]:
    """A duplicate start's input for its activity entry: whole up to ``DROPPED_INPUT_KEPT``
    bytes of JSON, else the sha256, size and first ``DROPPED_INPUT_PREVIEW`` characters of its
    JSON with sorted keys and no spaces."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    size = len(text.encode())
    if size <= DROPPED_INPUT_KEPT:
        return {"input": data}
    return {
        "input_digest": hashlib.sha256(text.encode()).hexdigest(),
        "input_bytes": size,
        "input_preview": text[:DROPPED_INPUT_PREVIEW],
    }


def settle_waiting_txn(
    rt: Runtime, conn: Connection, key_row: Any, status: str, workflow: Workflow | None
) -> Decision | None:
    """The holder of ``key_row`` just finished: the run waiting behind it takes the key, or is
    cancelled when ``reuse`` keeps it. The caller locked ``key_row`` before the holder's row."""
    if key_row is None or key_row.waiting_id is None:
        return None
    db, waiting_id = rt.db, key_row.waiting_id
    reuse = workflow.reuse if workflow is not None else "after_close"
    if reuse_frees(reuse, status):
        key_rows.hand_key_txn(db, conn, key_row.workflow, key_row.key, waiting_id)
        key_rows.let_waiting_run_go_txn(db, conn, waiting_id)
        activity_rows.record_txn(
            db,
            conn,
            "key_handed_off",
            waiting_id,
            key_row.workflow,
            key_row.key,
            {"from": key_row.holder_id, "from_status": status},
        )
        dispatch = (key_row.workflow, waiting_id, 0, 1, key_row.key)
        return Decision(
            waiting_id,
            publish=[dispatch],
            notices=[
                (
                    signals.key_handoff,
                    {
                        "run_id": waiting_id,
                        "workflow": key_row.workflow,
                        "key": key_row.key,
                        "previous_id": key_row.holder_id,
                    },
                )
            ],
        )
    reason = {
        "type": "Cancelled",
        "traceback": None,
        "message": f"run {key_row.holder_id} {status} and reuse={reuse!r} keeps the key",
    }
    queries.cancel_run_txn(db, conn, waiting_id, reason, UNFINISHED)
    key_rows.set_waiting_txn(conn, key_row.workflow, key_row.key, None)
    return Decision(
        waiting_id,
        notices=[
            (
                signals.run_finished,
                {"run_id": waiting_id, "workflow": key_row.workflow, "status": "cancelled"},
            )
        ],
    )


def start_run(
    rt: Runtime, workflow: Workflow, run: dict[str, Any], policy: str | SendEvent, fold: bool = True
) -> Decision:
    """Start a run in a transaction of its own: a new run or free key in one statement when it
    can (PostgreSQL), else the full decision. ``fold=False`` (a rerun): a debounced holder not
    yet claimed answers by ``policy`` too, instead of taking this start's input."""
    db = rt.db
    # A rate limit, a fair line, a batch: decided in a transaction.
    if not db.is_postgres or starts_in_transaction(workflow, run) or "batch_key" in run:
        with db.begin() as conn:
            return decide_start_txn(rt, conn, workflow, run, policy, fold=fold)
    with db.single() as conn:
        if run["key"] is None:
            # An outbox given to Durable(outbox=...) before sends_ahead existed never sends ahead.
            ahead = getattr(rt.outbox, "sends_ahead", False)
            if not (run["published"] and ahead and not limited(workflow)):
                queries.insert_run_txn(db, conn, run)
                return _created(workflow, run)
            # The first step's message goes out while the row commits (a worker that finds no
            # run yet waits on the start's lock: queries.await_start).
            sent: list[bool] = []
            queries.insert_run_txn(db, conn, run, sent=lambda: sent.append(_send_ahead(rt, workflow, run)))
            return _created(workflow, run, published=sent[0])
        if policy == "use_existing" and not workflow.debounce:
            created, holder_id = key_rows.start_or_answer(db, conn, run, dropped_input(run["input"]))
            if created:
                return _created(workflow, run)
            if holder_id is not None:
                notice = {
                    "run_id": holder_id,
                    "workflow": workflow.name,
                    "key": run["key"],
                    "outcome": "use_existing",
                }
                return Decision(holder_id, notices=[(signals.key_duplicate, notice)])
        elif key_rows.insert_run_with_key(db, conn, run):
            return _created(workflow, run)
        with db.then_transaction(conn):  # the key is held: decide on the same connection
            return decide_start_txn(rt, conn, workflow, run, policy, key_seen_held=True, fold=fold)


def _parked_at_start(run: dict[str, Any]) -> list[tuple[str, str]]:
    """The run's (workflow, slot key) if its start parked it for a slot (flow.py), else none."""
    return [(run["workflow"], run["slot_key"])] if run.get("flow_wait") is not None else []


def _send_ahead(rt: Runtime, workflow: Workflow, run: dict[str, Any]) -> bool:
    return rt.outbox.send_named(workflow.name or "", run["id"], 0, 1, None, soon=True)


def _created(workflow: Workflow, run: dict[str, Any], published: bool = False) -> Decision:
    """A new run's decision; ``published``: its first step's message has gone already."""
    decision = Decision(run["id"], created=True, parked=_parked_at_start(run))
    if run["published"] and not published:
        decision.publish.append((workflow.name or "", run["id"], 0, 1, run["key"]))
    decision.notices.append(
        (signals.run_started, {"run_id": run["id"], "workflow": workflow.name, "key": run["key"]})
    )
    return decision


def decide_start_txn(
    rt: Runtime,
    conn: Connection,
    workflow: Workflow,
    run: dict[str, Any],
    policy: str | SendEvent,
    key_seen_held: bool = False,
    fold: bool = True,
) -> Decision:
    """Insert a new run, or answer from the holder of its key (or put it in its batch); the
    caller commits."""
    if "batch_key" in run:
        return _batched(rt, conn, workflow, run)
    if run["key"] is None:
        admit_start_txn(rt, conn, workflow, run)
        queries.insert_run_txn(rt.db, conn, run)
        return _created(workflow, run)
    decision = KeyDecision(rt, conn, workflow, run, policy, fold).decide(key_seen_held)
    if decision.created:
        started = {"run_id": decision.run_id, "workflow": workflow.name, "key": run["key"]}
        decision.notices.insert(0, (signals.run_started, started))
    return decision


def _batched(rt: Runtime, conn: Connection, workflow: Workflow, run: dict[str, Any]) -> Decision:
    """A batch workflow's start: a new run opening its batch, or the run of the open batch it
    joined (sent now if the start filled it)."""

    def create() -> None:
        admit_start_txn(rt, conn, workflow, run)
        queries.insert_run_txn(rt.db, conn, run)

    run_id, full = batches.gather_txn(rt.db, conn, workflow, run, create)
    if run_id == run["id"]:
        return _created(workflow, run)
    decision = Decision(run_id)
    if full:
        decision.publish.append((workflow.name or "", run_id, 0, 1, None))
    return decision


def end_run_txn(
    rt: Runtime, conn: Connection, run: Any, status: str, end: Callable[[Connection], bool]
) -> tuple[bool, Decision | None]:
    """Finish ``run`` (id, key, workflow) with ``end(conn)``, locking its key row first and
    settling the run waiting behind it. Returns whether ``end`` finished it, and the hand-off."""
    key_row = key_rows.key_of_holder_txn(conn, run.id) if run.key else None
    if not end(conn):
        return False, None
    settled = settle_waiting_txn(rt, conn, key_row, status, rt.registry.workflows.get(run.workflow))
    return True, wake_parent_txn(rt, conn, run.id, settled)


def wake_parent_txn(
    rt: Runtime, conn: Connection, child_id: str, decision: Decision | None
) -> Decision | None:
    """Inside the transaction that finished ``child_id``: wake its parent if it waits for its
    children; returns ``decision`` (or a new one) carrying the parent's message."""
    woken = child_rows.wake_parent_txn(rt.db, conn, child_id)
    if woken is None:
        return decision
    decision = decision or Decision(child_id)
    decision.publish.append(tuple(woken))  # type: ignore[arg-type]
    return decision
