"""A reference model of workflow keys, written from docs/keys.md (and the few lines of
docs/compensation-and-children.md and docs/production.md on compensation and pruning), not from
the code.

It models one workflow with two steps, ``first`` (with a compensation) and ``second``:

- ``first`` succeeds or fails; a failed ``first`` ends the run ``failed`` (nothing before it to
  compensate);
- ``second`` succeeds (the run ``completed``), fails (the run ``compensating``: ``first``'s
  compensation is due) or waits for the event ``"upd"`` (the run ``waiting`` until it comes);
- the compensation succeeds (``compensated``) or fails (``compensation_failed``: one attempt).

Time is virtual, in ticks. The test maps a tick to ``TICK_SECONDS`` of the library's clock, and
every duration here is a whole number of ticks plus a half, or whole ticks compared with a
half-tick margin, so the few real seconds an example takes never tip a comparison.

Runs are numbered in the order they are created (0, 1, ...). An operation returns an
``Expect``: what the call returns or raises, with run numbers where the library gives ids, and
the activity entries it writes. New runs get the next numbers; the test binds them to the ids the
library returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

UNFINISHED = ("pending", "running", "waiting", "compensating")
FINISHED = ("completed", "failed", "cancelled", "compensated", "compensation_failed")
POLICIES = ("use_existing", "error", "cancel_existing", "run_again", "send_event")
EVENT = "upd"  # the event ``second`` waits for, and the one SendEvent(EVENT) delivers

# docs/keys.md, "Choosing reuse": may a new start take the key from a finished holder?
REUSE_FREES = {
    "after_close": {s: True for s in FINISHED},
    "after_failure": {**{s: True for s in FINISHED}, "completed": False},
    "never": {s: False for s in FINISHED},
}

# docs/production.md, "Retention": the prune rules and the statuses each covers.
PRUNE_RULES = {
    "completed": ("completed",),
    "cancelled": ("cancelled",),
    "failed": ("failed", "compensated", "compensation_failed"),
}
PRUNE_AGE = 1.5  # ticks: a run finished two ticks ago is pruned, one tick ago is kept
PERIOD = 2.5  # debounce period, in ticks


def frees(reuse: str, status: str) -> bool:
    """Does ``reuse`` let a new start take the key from a holder in ``status``?"""
    return status in FINISHED and REUSE_FREES[reuse][status]


@dataclass(frozen=True)
class Ref:
    """A run by its number, where the library gives a run id."""

    index: int


@dataclass
class Expect:
    """What one call should come to."""

    returns: Any = None  # a value, or a Ref
    raises: str | None = None  # the error's class name
    holder: int | None = None  # KeyTaken's holder_id
    activity: list[dict[str, Any]] = field(default_factory=list)  # kind, run, details (Refs inside)
    new_runs: list[int] = field(default_factory=list)  # runs this call created, in order


@dataclass
class Run:
    index: int
    key: str | None
    input: dict[str, Any]
    status: str = "pending"
    claimed: bool = False  # a worker has picked it up at least once (docs: "picked up")
    stage: int = 0  # the step that runs next: 0 first, 1 second
    attempt: int = 1  # of the step at ``stage``
    due: float | None = 0.0  # virtual time when a worker may claim it; None: not until woken
    not_after: float | None = None  # debounce cap: the first start + timeout
    runs_after: int | None = None  # a run_again run: the holder it waits behind
    finished_at: float | None = None
    kept: dict[str, list[Any]] = field(default_factory=dict)  # events kept, oldest first
    received: dict[str, Any] = field(default_factory=dict)
    wait_name: str | None = None
    output: Any = None
    error: tuple[Any, ...] | None = None  # ("cancelled",) ("replaced", new) ("kept", holder, status)
    pruned: bool = False


@dataclass
class KeyRow:
    holder: int
    waiting: int | None = None


class KeyModel:
    """One workflow's keys and runs, by the key guide."""

    def __init__(self, reuse: str, debounce_timeout: float | None, debounce: bool, default: str) -> None:
        self.reuse = reuse
        self.debounce = debounce
        self.timeout = debounce_timeout  # ticks, or None: no cap
        self.default = default
        self.now = 0.0
        self.runs: list[Run] = []
        self.keys: dict[str, KeyRow] = {}
        self.duplicates: dict[str, int] = {}  # key_duplicate entries per key (readds)

    # -- reading ------------------------------------------------------------------------------

    def live(self) -> list[Run]:
        return [r for r in self.runs if not r.pruned]

    def holds_key(self, run: Run) -> bool:
        row = self.keys.get(run.key) if run.key is not None else None
        return row is not None and row.holder == run.index

    def blocks(self, key: str) -> bool:
        """docs/keys.md, list_keys: a new start with the key gets the holder."""
        holder = self.runs[self.keys[key].holder]
        return holder.status in UNFINISHED or not frees(self.reuse, holder.status)

    def claimable(self, run: Run, compensate: bool) -> bool:
        if run.pruned:
            return False
        if compensate:
            return run.status == "compensating"
        if run.status not in ("pending", "running", "waiting"):
            return False
        return run.due is not None and run.due <= self.now

    # -- building blocks ----------------------------------------------------------------------

    def _new_run(self, key: str | None, data: dict[str, Any], expect: Expect, **fields: Any) -> Run:
        run = Run(len(self.runs), key, dict(data), due=self.now, **fields)
        if self.debounce and key is not None:  # "a keyed start waits period before it runs"
            run.due = self.now + PERIOD
            if self.timeout is not None:
                run.not_after = self.now + self.timeout
        self.runs.append(run)
        expect.new_runs.append(run.index)
        return run

    def _entry(self, expect: Expect, kind: str, run: int, key: str, **details: Any) -> None:
        expect.activity.append({"kind": kind, "run": run, "key": key, "details": details})
        if kind == "key_duplicate":
            self.duplicates[key] = self.duplicates.get(key, 0) + 1

    def _duplicate(
        self,
        expect: Expect,
        holder: Run,
        key: str,
        data: dict[str, Any],
        outcome: str,
        policy: str,
        **extra: Any,
    ) -> None:
        """The key_duplicate entry, on the holder: docs/keys.md, "Activity"."""
        details = {
            "outcome": outcome,
            "policy": policy,
            "input_changed": holder.input != data,
            "input": dict(data),
            "holder_status": holder.status,
            **extra,
        }
        self._entry(expect, "key_duplicate", holder.index, key, **details)

    def _handed_off(self, expect: Expect, new: Run, key: str, previous: Run, status: str) -> None:
        self._entry(
            expect, "key_handed_off", new.index, key, **{"from": Ref(previous.index), "from_status": status}
        )

    def _end(self, run: Run, status: str, expect: Expect, error: tuple[Any, ...] | None = None) -> None:
        """The run finishes; a run_again run waiting behind it takes the key or is cancelled."""
        run.status, run.finished_at, run.due, run.wait_name = status, self.now, None, None
        if error is not None:
            run.error = error
        row = self.keys.get(run.key) if run.key is not None else None
        if row is None or row.holder != run.index or row.waiting is None:
            return
        waiting = self.runs[row.waiting]
        row.waiting = None
        if frees(self.reuse, status):  # "takes the key ... and is sent to a worker"
            row.holder = waiting.index
            waiting.status, waiting.due = "pending", self.now
            self._handed_off(expect, waiting, run.key, run, status)  # type: ignore[arg-type]
        else:  # "if the holder completed, reuse keeps the key: the waiting run is cancelled"
            waiting.status, waiting.finished_at, waiting.due = "cancelled", self.now, None
            waiting.error = ("kept", run.index, status)

    def _deliver(self, run: Run, name: str, payload: Any) -> None:
        """An event is kept; a run waiting for that name is sent to a worker."""
        run.kept.setdefault(name, []).append(payload)
        if run.status == "waiting" and run.wait_name == name:
            run.due = self.now

    # -- operations ---------------------------------------------------------------------------

    def start(self, key: str | None, data: dict[str, Any], policy: str | None) -> Expect:
        """``durable.start(wf, data, key=key, on_duplicate=policy)``."""
        expect = Expect()
        asked = self.default if policy is None else policy
        if asked == "run_again" and self.reuse == "never":  # refused before anything is written
            expect.raises = "InvalidStart"
            return expect
        shown = f"send_event:{EVENT}" if asked == "send_event" else asked
        row = self.keys.get(key) if key is not None else None
        if key is None or row is None:
            run = self._new_run(key, data, expect)
            if key is not None:
                self.keys[key] = KeyRow(run.index)
            expect.returns = Ref(run.index)
            return expect
        holder = self.runs[row.holder]
        if holder.status in FINISHED:
            return self._start_on_finished(expect, key, row, holder, data, asked, shown)
        # Unfinished holder. A debounced run not yet picked up takes every start's input.
        if self.debounce and holder.status == "pending" and not holder.claimed:
            self._duplicate(expect, holder, key, data, "debounced", shown)
            holder.input = dict(data)
            cap = holder.not_after if holder.not_after is not None else math.inf
            holder.due = min(self.now + PERIOD, cap)
            expect.returns = Ref(holder.index)
            return expect
        if asked == "send_event":
            self._duplicate(expect, holder, key, data, "send_event", shown, event=EVENT)
            self._deliver(holder, EVENT, dict(data))
            expect.returns = Ref(holder.index)
            return expect
        if asked == "use_existing":
            self._duplicate(expect, holder, key, data, "use_existing", shown)
            expect.returns = Ref(holder.index)
            return expect
        if asked == "cancel_existing" and holder.status != "compensating":
            return self._replace(expect, key, row, holder, data, shown)
        if asked == "run_again":
            return self._run_again(expect, key, row, holder, data, shown)
        # "error", and cancel_existing against a compensating holder
        self._duplicate(expect, holder, key, data, "error", shown)
        expect.raises, expect.holder = "KeyTaken", holder.index
        return expect

    def _start_on_finished(
        self, expect: Expect, key: str, row: KeyRow, holder: Run, data: dict[str, Any], asked: str, shown: str
    ) -> Expect:
        if frees(self.reuse, holder.status):
            run = self._new_run(key, data, expect)
            row.holder, row.waiting = run.index, None
            self._handed_off(expect, run, key, holder, holder.status)
            expect.returns = Ref(run.index)
        elif asked == "use_existing":
            self._duplicate(expect, holder, key, data, "use_existing", shown)
            expect.returns = Ref(holder.index)
        else:  # "every other policy raises KeyTaken"
            self._duplicate(expect, holder, key, data, "error", shown)
            expect.raises, expect.holder = "KeyTaken", holder.index
        return expect

    def _replace(
        self, expect: Expect, key: str, row: KeyRow, holder: Run, data: dict[str, Any], shown: str
    ) -> Expect:
        """cancel_existing: the holder (and the run waiting behind it) cancelled, a new run holds."""
        run = self._new_run(key, data, expect)
        self._duplicate(expect, holder, key, data, "cancel_existing", shown, replaced_by=Ref(run.index))
        self._handed_off(expect, run, key, holder, holder.status)
        for old in (holder.index, row.waiting):
            if old is not None:
                gone = self.runs[old]
                gone.status, gone.finished_at, gone.due, gone.wait_name = "cancelled", self.now, None, None
                gone.error = ("replaced", run.index)
        row.holder, row.waiting = run.index, None
        expect.returns = Ref(run.index)
        return expect

    def _run_again(
        self, expect: Expect, key: str, row: KeyRow, holder: Run, data: dict[str, Any], shown: str
    ) -> Expect:
        if holder.status == "pending" and not holder.claimed:  # takes the newer input itself
            self._duplicate(expect, holder, key, data, "run_again", shown)
            holder.input = dict(data)
            expect.returns = Ref(holder.index)
            return expect
        if row.waiting is not None:  # "one run waits ... always with the newest input"
            waiting = self.runs[row.waiting]
            self._duplicate(expect, holder, key, data, "run_again", shown, runs_after=Ref(waiting.index))
            waiting.input = dict(data)
            expect.returns = Ref(waiting.index)
            return expect
        waiting = self._new_run(key, data, expect, status="waiting", runs_after=holder.index)
        waiting.due = None
        row.waiting = waiting.index
        self._duplicate(expect, holder, key, data, "run_again", shown, runs_after=Ref(waiting.index))
        expect.returns = Ref(waiting.index)
        return expect

    def claim(self, index: int) -> Expect:
        """A worker gets the message for the run's current step (or compensation): it runs if
        the run is due ("ran"), else the message does nothing ("dropped")."""
        expect = Expect()
        run = self.runs[index]
        compensate = run.status == "compensating"
        if not self.claimable(run, compensate):
            expect.returns = "dropped"
            return expect
        expect.returns = "ran"
        run.claimed = True
        if not compensate:  # while its step runs, the run is running (and holds no due time)
            run.status, run.due, run.wait_name = "running", None, None
        return expect

    def finish(self, index: int, outcome: str) -> Expect:
        """The claimed step (or compensation) ends by the behaviour the test chose: "ok",
        "fail" or "wait" ("wait" is "ok" where nothing waits). A run cancelled while its step
        ran stays cancelled: the step's result is not recorded."""
        expect = Expect()
        run = self.runs[index]
        if run.status == "cancelled":
            return expect
        if run.status == "compensating":
            self._end(run, "compensation_failed" if outcome == "fail" else "compensated", expect)
        elif run.stage == 0:
            if outcome == "fail":
                self._end(run, "failed", expect, error=("failed",))
            else:
                run.status, run.stage, run.due, run.attempt = "running", 1, self.now, 1
        elif outcome == "fail":
            run.status, run.due, run.error = "compensating", self.now, ("failed",)
        elif outcome == "wait" and EVENT not in run.received and not run.kept.get(EVENT):
            run.status, run.due, run.wait_name = "waiting", None, EVENT  # parked until the event
        elif outcome == "wait":
            # "The first time it waits for a name it receives the newest event kept by then."
            if EVENT not in run.received:
                run.received[EVENT] = run.kept[EVENT][-1]
            run.output = {"event": run.received[EVENT]}
            self._end(run, "completed", expect)
        else:
            run.output = {"v": run.input["v"]}
            self._end(run, "completed", expect)
        return expect

    def cancel(self, index: int) -> Expect:
        expect = Expect()
        run = self.runs[index]
        if run.pruned:
            expect.raises = "RunNotFound"
        elif run.status in FINISHED or run.status == "compensating":
            expect.returns = False  # a compensating run cannot be cancelled
        else:
            row = self.keys.get(run.key) if run.key is not None else None
            if row is not None and row.waiting == index:  # "just removes it"
                row.waiting = None
            self._end(run, "cancelled", expect, error=("cancelled",))
            # docs/watching.md: a cancel writes a `cancelled` entry, who and from where (none here).
            self._entry(expect, "cancelled", index, run.key, by=None, **{"from": None})
            expect.returns = True
        return expect

    def retry(self, index: int) -> Expect:
        """docs/keys.md, "Retry, rerun and releasing a key"."""
        expect = Expect()
        run = self.runs[index]
        if run.pruned:
            expect.raises = "RunNotFound"
            return expect
        if run.status in UNFINISHED:
            expect.raises = "NotFinished"
            return expect
        if run.status != "failed":
            expect.raises = "InvalidArgument"
            return expect
        if run.key is not None:
            row = self.keys.get(run.key)
            if row is None:  # released, or its holder was pruned: the key is free
                self.keys[run.key] = KeyRow(index)
                self._entry(expect, "key_retaken", index, run.key, **{"from": None})
            elif row.holder != index:
                newer = self.runs[row.holder]
                if not frees(self.reuse, newer.status):  # "a refused retry writes nothing"
                    expect.raises, expect.holder = "KeyTaken", newer.index
                    return expect
                row.holder, row.waiting = index, None
                self._entry(expect, "key_retaken", index, run.key, **{"from": Ref(newer.index)})
        run.status, run.due, run.finished_at, run.error = "running", self.now, None, None
        run.attempt += 1  # docs/watching.md: a `retried` entry, with the step and its next attempt
        step = ("first", "second")[run.stage]
        self._entry(
            expect, "retried", index, run.key, by=None, step=step, attempt=run.attempt, **{"from": None}
        )
        expect.returns = Ref(index)
        return expect

    def rerun(self, index: int) -> Expect:
        """A fresh copy by the start rules, KeyTaken instead of the holder, never folded."""
        expect = Expect()
        run = self.runs[index]
        if run.pruned:
            expect.raises = "RunNotFound"
            return expect
        if run.status not in FINISHED:
            expect.raises = "NotFinished"
            return expect
        key, data = run.key, run.input
        row = self.keys.get(key) if key is not None else None
        if key is None or row is None:
            fresh = self._new_run(key, data, expect)
            if key is not None:
                self.keys[key] = KeyRow(fresh.index)
            expect.returns = Ref(fresh.index)
            return expect
        holder = self.runs[row.holder]
        if frees(self.reuse, holder.status):
            fresh = self._new_run(key, data, expect)
            row.holder, row.waiting = fresh.index, None
            self._handed_off(expect, fresh, key, holder, holder.status)
            expect.returns = Ref(fresh.index)
            return expect
        # "The refused rerun leaves one key_duplicate activity entry on the holder with outcome error"
        self._duplicate(expect, holder, key, data, "error", "error")
        expect.raises, expect.holder = "KeyTaken", holder.index
        return expect

    def release_key(self, index: int, by: str) -> Expect:
        expect = Expect()
        run = self.runs[index]
        if run.pruned:
            expect.raises = "RunNotFound"
        elif run.status not in FINISHED:
            expect.raises = "NotFinished"
        elif not self.holds_key(run):
            expect.raises = "NoKey"
        else:
            del self.keys[run.key]  # type: ignore[arg-type]
            self._entry(expect, "key_released", index, run.key, by=by)  # type: ignore[arg-type]
        return expect

    def send_event(self, index: int, name: str, payload: Any, buffer: bool) -> Expect:
        """docs/keys.md, SendEvent: kept with buffer=True, else only for a run waiting now."""
        expect = Expect()
        run = self.runs[index]
        if run.pruned:
            expect.raises = "RunNotFound"
        elif run.status in FINISHED:
            expect.returns = False
        elif buffer or (run.status == "waiting" and run.wait_name == name):
            self._deliver(run, name, payload)
            expect.returns = True
        else:
            expect.returns = False
        return expect

    def prune(self) -> Expect:
        """The prune rules, each PRUNE_AGE ticks: finished runs past it go, and their keys."""
        expect = Expect()
        counts = dict.fromkeys(PRUNE_RULES, 0)
        for run in self.live():
            if run.status in FINISHED and self.now - run.finished_at >= PRUNE_AGE:  # type: ignore[operator]
                run.pruned = True
                counts[next(r for r, s in PRUNE_RULES.items() if run.status in s)] += 1
                if self.holds_key(run):
                    del self.keys[run.key]  # type: ignore[arg-type]
        expect.returns = counts
        return expect

    def tick(self, ticks: int) -> Expect:
        self.now += ticks
        return Expect()
