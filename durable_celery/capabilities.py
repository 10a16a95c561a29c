"""What a storage backend can do: ``Capability`` flags, and the one check every feature makes.

======================  ==========  ===========  ======
capability              PostgreSQL  SQLite file  memory
======================  ==========  ===========  ======
IDEMPOTENCY_KEY         yes         yes          yes
EVENTS                  yes         yes          yes
WAITS                   yes         yes          yes
CHILDREN                yes         yes          yes
SCHEDULES               yes         yes          yes
TRANSACTIONS            yes         yes          yes
SKIP_LOCKED             yes         no           no
MULTI_PROCESS           yes         yes          no
FLOW_CONTROL            yes         yes          yes
ATOMIC_STEPS            yes         no           no
======================  ==========  ===========  ======

A ``Durable`` (or a ``testing.Fake``) may be told to claim fewer than its backend has; a call
that needs a missing one raises ``Unsupported`` before it writes anything.
"""

from __future__ import annotations

import enum

from .errors import Unsupported


class Capability(enum.Flag):
    """A feature a storage backend supports."""

    IDEMPOTENCY_KEY = enum.auto()  # start(key=...): at most one unfinished run per key
    EVENTS = enum.auto()  # send_event, wait_for_event, on_duplicate=SendEvent(...)
    WAITS = enum.auto()  # sleep, sleep_until, snooze, wait_for_input / provide_input
    CHILDREN = enum.auto()  # call_workflow, start_workflow, parallel
    SCHEDULES = enum.auto()  # keyed cron schedules (RedBeat or DurableScheduler)
    TRANSACTIONS = enum.auto()  # start(connection=...): a run written in the caller's transaction
    SKIP_LOCKED = enum.auto()  # relays and sweeps of many workers share work without waiting
    MULTI_PROCESS = enum.auto()  # workers and producers in several processes share the store
    # concurrency= (with fair keys), throttle=, rate_limit= per key, priorities (core/flow.py), batch=
    FLOW_CONTROL = enum.auto()
    # @wf.step(atomic=True) (core/atomic.py): a step's transaction stays open while it runs, which
    # SQLite's one writer at a time would make every other write (heartbeats too) wait for.
    ATOMIC_STEPS = enum.auto()
    ALL = (
        IDEMPOTENCY_KEY
        | EVENTS
        | WAITS
        | CHILDREN
        | SCHEDULES
        | TRANSACTIONS
        | SKIP_LOCKED
        | MULTI_PROCESS
        | FLOW_CONTROL
        | ATOMIC_STEPS
    )


def of_backend(*, postgres: bool, memory: bool) -> Capability:
    """What a backend supports: PostgreSQL everything, a SQLite file all but SKIP_LOCKED and
    ATOMIC_STEPS, the in-memory store also not MULTI_PROCESS."""
    if postgres:
        return Capability.ALL
    lacking = Capability.SKIP_LOCKED | Capability.ATOMIC_STEPS
    lacking |= Capability.MULTI_PROCESS if memory else Capability(0)
    return Capability.ALL & ~lacking


def require(have: Capability, needed: Capability, operation: str, what: str, workflow: str | None) -> None:
    """Raise Unsupported unless ``have`` holds ``needed``: ``start: key unsupported by this
    backend (missing IDEMPOTENCY_KEY): run of workflow 'invoice'``."""
    if needed in have:
        return
    missing = needed & ~have
    names = "|".join(flag.name or "" for flag in Capability if flag in missing and flag is not Capability.ALL)
    subject = f"run of workflow {workflow!r}" if workflow is not None else "this call"
    raise Unsupported(f"{operation}: {what} unsupported by this backend (missing {names}): {subject}")
