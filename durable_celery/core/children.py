"""Child workflows and parallel branches: runs a step starts and (maybe) waits for.

A child is an ordinary run with ``parent_id`` set and ``parent_ref`` naming the call that made
it (step, attempt and call number). A step that runs again (it waited, snoozed, or its worker
was lost) makes the same calls in the same order, finds the children it already started and
never starts second copies; a new attempt of a failed step starts fresh children. A parent
that waits for children parks (worker freed) until one of them finishes and wakes it.

With tracing on, a child is stamped as a top-level start is (``tracing.stamp_run``) while the
parent step's span is current, so the child's trace is the parent's, under that step attempt.

Children never inherit the parent's key. A keyed child is started with ``on_duplicate="error"``:
a step cannot wait for a run that is not its own child.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import IntegrityError

from ..capabilities import Capability
from ..definition import ParallelGroup, Workflow
from ..errors import ChildFailed, InvalidArgument
from ..inputs import check_input
from ..store import child_rows
from ..store.schema import FINISHED
from .control import after_commit, cancel
from .heartbeat import STOPS, stop_reason
from .keys import Decision, decide_start_txn
from .runs import new_run
from .waits import Parked

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from .run_state import RunState
    from .runtime import Runtime

# A branch: a workflow (or its name) and its input.
Call = tuple["str | Workflow", "Mapping[str, Any] | None"]


def call_workflow(
    run: RunState, workflow: str | Workflow, input: Mapping[str, Any] | None, key: str | None
) -> Any:
    """Start a child (once) and wait for it: its output, or ChildFailed."""
    child = _start_children(run, {_ref(run): (workflow, input, key)}, None)[0]
    if child.status not in FINISHED:
        raise Parked(child_rows.CHILDREN_WAIT, None, children=[child.id])
    return _output(child)


def start_workflow(
    run: RunState, workflow: str | Workflow, input: Mapping[str, Any] | None, key: str | None
) -> str:
    """Start a child (once) without waiting for it; returns its id."""
    return str(_start_children(run, {_ref(run): (workflow, input, key)}, None)[0].id)


def fan_out(run: RunState, group: ParallelGroup, **_input: Any) -> None:
    """Run a parallel step (``Workflow.parallel``): each branch a child run with the run's
    input and a copy of its context; their return values land in the context by name."""
    calls = {name: (wf, run.input) for name, wf in group.branches.items()}
    run.context.update(parallel(run, calls, group.fail_fast, context=run.context))


def parallel(
    run: RunState,
    calls: Sequence[Call] | Mapping[str, Call],
    fail_fast: bool,
    context: Mapping[str, Any] | None = None,
) -> Any:
    """Run ``calls`` as branches at once and wait for all: their outputs (a list, or a dict
    for a dict of calls). With ``fail_fast`` the first failed branch cancels the others."""
    named = dict(calls) if isinstance(calls, Mapping) else dict(enumerate(calls))
    if not named:
        raise InvalidArgument("parallel() needs at least one branch")
    base = _ref(run)
    wanted = {}
    for name, call in named.items():
        if not isinstance(call, (tuple, list)) or len(call) != 2:
            raise InvalidArgument(f"a branch is a (workflow, input) pair, not {call!r}")
        wanted[f"{base}:{name}"] = (call[0], call[1], None)
    children = dict(zip(named, _start_children(run, wanted, context), strict=True))
    failed = [c for c in children.values() if c.status in FINISHED and c.status != "completed"]
    pending = [c.id for c in children.values() if c.status not in FINISHED]
    if failed and (fail_fast or not pending):
        _cancel_all(run, pending)
        raise ChildFailed(failed[0].id, failed[0].status, failed[0].error)
    if pending:
        raise Parked(child_rows.CHILDREN_WAIT, None, children=pending)
    outputs = {name: child.output for name, child in children.items()}
    return outputs if isinstance(calls, Mapping) else [outputs[i] for i in range(len(named))]


def _ref(run: RunState) -> str:
    """This call's place in the step: step index, attempt, and how many calls came before."""
    run._calls += 1
    return f"{run._step_index}:{run.attempt}:{run._calls}"


def _output(child: Any) -> Any:
    if child.status != "completed":
        raise ChildFailed(child.id, child.status, child.error)
    return child.output


def _start_children(
    run: RunState,
    wanted: Mapping[str, tuple[str | Workflow, Mapping[str, Any] | None, str | None]],
    context: Mapping[str, Any] | None,
) -> list[Any]:
    """The children at ``wanted`` refs, starting those that do not exist yet (one transaction)."""
    rt = run._active.engine.rt
    with rt.db.engine.connect() as conn:  # the children carry the run's tags
        tags = child_rows.tags_of(conn, run.id)
    prepared = {ref: _prepare(rt, run, ref, *call, context, tags) for ref, call in wanted.items()}
    for _ in range(2):  # a second pass only if a twin of this step inserted the same refs
        try:
            with rt.db.begin() as conn:
                found, decisions = _insert_missing(rt, conn, run.id, prepared)
                _check_parent(conn, run)
            break
        except IntegrityError:
            continue
    else:
        raise InvalidArgument("the same children were started twice at once")
    for decision in decisions:
        after_commit(rt, decision)
    return [found[ref] for ref in wanted]


def _prepare(
    rt: Runtime,
    run: RunState,
    ref: str,
    workflow: str | Workflow,
    input: Mapping[str, Any] | None,
    key: str | None,
    context: Mapping[str, Any] | None,
    tags: dict[str, str] | None,
) -> tuple[Workflow, dict[str, Any]]:
    wf = rt.registry.resolve(workflow)
    data = check_input(input, rt.settings.max_input_bytes)
    child_key = wf.derive_key(data, key)
    if child_key is not None:
        rt.require(Capability.IDEMPOTENCY_KEY, "child", "key", wf.name)
    child = new_run(rt.default_queue(), wf, data, child_key, tags, aging=rt.settings.priority_aging)
    child.update(parent_id=run.id, parent_ref=ref, context=dict(context or {}))
    return wf, child


def _insert_missing(
    rt: Runtime,
    conn: Connection,
    parent_id: str,
    prepared: Mapping[str, tuple[Workflow, dict[str, Any]]],
) -> tuple[dict[str, Any], list[Decision]]:
    found = child_rows.children_by_refs_txn(conn, parent_id, list(prepared))
    decisions = []
    for ref, (wf, child) in prepared.items():
        if ref in found:
            continue  # a replay found it: it keeps the trace it was started with
        if "trace_parent" not in child:  # not already stamped by a pass that rolled back
            # Stamped here, not in _prepare, so a replay opens no start span for a run it
            # does not start. The step's span is current: the child joins the parent's trace.
            rt.instrumentation.stamp_run(wf, child)
        decision = decide_start_txn(rt, conn, wf, child, "error")
        if decision.error is not None:
            raise decision.error  # rolls back the children started with it
        decisions.append(decision)
    found.update(child_rows.children_by_refs_txn(conn, parent_id, [r for r in prepared if r not in found]))
    return found, decisions


def _check_parent(conn: Connection, run: RunState) -> None:
    """Refuse (and roll back) children of a run that was cancelled or taken over meanwhile.

    Checked last in the transaction, after the children's key rows, so the lock order matches
    a finishing child's (its key, then its parent) and the two cannot deadlock.
    """
    parent = child_rows.parent_state_txn(conn, run.id)
    fence, holder = run._active.fence, run._active.holder
    held = parent is not None and (parent.fence, parent.locked_by) == (fence, holder)
    if not held or parent.status not in ("running", "compensating"):
        reason = stop_reason(parent, fence, holder)
        run._active.stop_reason = reason
        raise STOPS[reason]()


def _cancel_all(run: RunState, run_ids: Sequence[str]) -> None:
    for run_id in run_ids:
        cancel(run._active.engine.rt, run_id)
