"""The outbox relay: sends the message of every due run that has none on its way.

A run's first message goes out after the transaction that made it due; the relay sends what
that missed (a publish that failed, a process that died in between) and re-sends a message
that seems lost. A re-send is a guess, so it is made sparingly:

* the first ``relay_after`` seconds after the run became due, then at doubling intervals (at
  most ``RESEND_MAX`` apart) while the run stays unclaimed;
* never into a queue no live worker node consumes (``doctor`` reports those runs as
  ``no_consumer``): the message already sent waits there for a worker;
* never more than the queue could have lost: when the broker holds as many messages in the
  queue as it has sent, unclaimed runs, every one may still be on its way, and none is re-sent.

A pass stops at the first message the broker refuses (it is down): the rest stay flagged
unsent for the next pass, which the upkeep thread makes later and later while the broker is
away, so an outage never ties up a pass, nor fills the queue on its return. A pass after a
refusal is a ``probe``: it takes one run first, and a batch only once that one went out, so
each pass of an outage writes one row, not a batch taken and flagged back.

When a worker's consumer reconnects to the broker (broker_reconnect.py), :func:`resend_lost`
makes a pass at once that does not wait ``relay_after``: a broker that restarted without
persistence lost its queues, and a producer stopped before it flagged its runs left them
marked sent. Each queue gets as many re-sends as its sent, unclaimed runs outnumber the
messages the broker holds in it (the same budget), oldest first; the runs over budget are left
as they were.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..core.rollout import defer, fail_changed, known_elsewhere
from ..store import node_rows, queries

if TYPE_CHECKING:
    from ..core.runtime import Runtime

log = logging.getLogger("durable_celery")

RELAY_BATCH = 500
RESEND_MAX = 3600.0  # the longest wait between two re-sends of one run's message


class BrokerDown(Exception):
    """The broker refused a message: the relay pass stopped there."""


def resend_lost(rt: Runtime, app: Any) -> int:
    """After a reconnect: a relay pass whose re-sends do not wait ``relay_after`` (each queue's
    budget still applies); returns how many were sent."""
    return relay_once(rt, app, lost=True)


def relay_once(rt: Runtime, app: Any, lost: bool = False, probe: bool = False) -> int:
    """Send every due run's message (new, woken or lost); returns how many were sent.

    ``lost``: a sent, unclaimed run is due for a re-send now, not ``relay_after`` after it
    became due. ``probe`` (the broker refused the last pass): one run first, then batches.
    Raises BrokerDown when the broker refused one (what was left stays flagged).
    """
    known = list(rt.registry.workflows)
    if not known:
        return 0
    s, db = rt.settings, rt.db
    after = 0.0 if lost else s.relay_after  # how long a sent run stays unclaimed before a re-send
    budget: dict[str | None, int] | None = None  # worked out once a re-send is due, not before
    sent, size = 0, 1 if probe else RELAY_BATCH
    while True:
        with db.begin() as conn:
            rows = queries.take_due_runs_txn(db, conn, after, size, known)
            if budget is None and any(row.resend for row in rows):
                conn.rollback()  # the rows' locks go while the broker is asked; taken again below
                budget = _budget(rt, app, after, known)
                continue
            to_send, marks = _choose(rows, budget or {}, s.relay_after, keep=lost)
            queries.mark_relayed_txn(db, conn, marks)
        for n, row in enumerate(to_send):
            if not _send(rt, row):
                with db.begin() as conn:
                    queries.mark_unsent(conn, [r.id for r in to_send[n:]])
                raise BrokerDown(f"the broker refused run {row.id}'s message; {len(to_send) - n} left")
            sent += 1
        if len(rows) < size or (lost and not to_send):  # rows kept as they were come back
            return sent
        size = RELAY_BATCH


def _budget(rt: Runtime, app: Any, after: float, known: Sequence[str]) -> dict[str | None, int]:
    """Each queue's re-send budget (below), read only in a pass that met a re-send due: the
    count of sent, unclaimed runs reads the whole ready backlog."""
    db, s = rt.db, rt.settings
    with db.engine.connect() as conn:
        candidates = queries.relay_candidates(db, conn, after, known)
        # No live node known (a relay run from the command line, say): no queue is ruled out.
        consumed = node_rows.live_queues(db, conn, s.stale_lock_timeout) if candidates else set()
    return resend_budget(app, candidates, consumed)


def resend_budget(app: Any, candidates: Sequence[Any], consumed: set[str]) -> dict[str | None, int]:
    """How many messages each queue may get again: none where no live node consumes it, and no
    more than its sent, unclaimed runs outnumber the messages the broker still holds."""
    if not candidates:
        return {}
    depths = broker_depths(app, [c.queue for c in candidates if c.queue is not None])
    budget: dict[str | None, int] = {}
    for c in candidates:
        if depths is None:  # the broker cannot say: a re-send would not get through either
            budget[c.queue] = 0
        elif c.queue is None:
            budget[c.queue] = c.unclaimed
        elif consumed and c.queue not in consumed:
            budget[c.queue] = 0
        else:
            budget[c.queue] = max(0, c.unclaimed - depths.get(c.queue, 0))
    return budget


def _choose(
    rows: Sequence[Any], budget: dict[str | None, int], relay_after: float, keep: bool = False
) -> tuple[list[Any], list[dict[str, Any]]]:
    """The rows to send, and how each row taken is marked (sent, or looked at again later;
    ``keep``: a row not sent is left as it was)."""
    to_send: list[Any] = []
    marks: list[dict[str, Any]] = []
    for row in rows:
        resends = 0
        if row.resend:  # sent before and still unclaimed
            if budget.get(row.queue, 0) <= 0:  # it may still be on its way: look again later
                if not keep:
                    marks.append(_mark(row.id, row.resends, relay_after))
                continue
            budget[row.queue] -= 1
            resends = row.resends + 1
        to_send.append(row)
        marks.append(_mark(row.id, resends, relay_after))
    return to_send, marks


def _mark(run_id: str, resends: int, relay_after: float) -> dict[str, Any]:
    after = min(relay_after * 2**resends, max(RESEND_MAX, relay_after))
    return {"b_id": run_id, "b_resends": resends, "b_after": after}


def _send(rt: Runtime, row: Any) -> bool:
    """Send one run's message (or hand it back or fail it when this code lacks its step);
    False when the broker refused it."""
    workflow = rt.registry.workflows[row.workflow]
    if not _has_step(workflow, row.step_index, row.step_name):
        # newer code elsewhere (a rolling deploy), or the step was renamed or removed
        if row.step_name is not None and known_elsewhere(rt, row.workflow, row.step_name):
            defer(rt, row.id, row.workflow, row.step_name, row.step_index)
        else:
            fail_changed(rt, row.id, row.workflow, row.step_name, row.step_index)
        return True
    compensate = row.status == "compensating"
    return rt.outbox.send(workflow, row.step_index, row.id, row.attempt, row.key, compensate=compensate)


def _has_step(workflow: Any, index: int, name: str | None) -> bool:
    if index >= len(workflow.steps):
        return False
    return name is None or workflow.steps[index].name == name


def broker_depths(app: Any, names: Iterable[str]) -> dict[str, int] | None:
    """Messages waiting in each named queue on the broker (0 for a queue it does not have), or
    None when the broker cannot be asked."""
    names = sorted(set(names))
    depths: dict[str, int] = {}
    try:
        with app.connection_for_read() as conn:
            conn.ensure_connection(max_retries=1)
            for name in names:
                with conn.channel() as channel:
                    try:
                        depths[name] = channel.queue_declare(queue=name, passive=True).message_count
                    except conn.channel_errors:  # no such queue: nothing waits in it
                        depths[name] = 0
    except Exception as exc:  # the broker is away: no re-sends this pass
        log.debug("durable: could not read queue depths (%s)", exc)
        return None
    return depths
