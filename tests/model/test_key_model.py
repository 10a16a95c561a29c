"""The key table, model-checked: hypothesis drives the real library (PostgreSQL and the embedded
SQLite default) with random sequences of starts, worker passes, cancels, retries, reruns, key
releases, events, prunes and clock ticks, and after every step compares it with the reference
model in ``model.py`` (written from docs/keys.md).

Compared after every step: what the call returned or raised (ids, ``KeyTaken.holder_id``), every
run of the workflow (status, input, key, ``holds_key``, ``runs_after_id``, output, why it was
cancelled), every key (holder, waiting run, holder status, ``blocks``, runs, re-adds), the
activity entries and signals the step produced, ``stats.keys()``, and for starts and reruns the
step messages sent (none for a start a holder answered).

Workers are this process: ``durable.run_message`` claims a run and runs one step (or
compensation) in-process, with a behaviour the state machine chose (succeed, fail, wait for the
event ``"upd"``), and sometimes an operation made from inside the step while it runs (a start
with the run's key, a cancel of the run, an event to it).

Time: the library reads its clock from PostgreSQL's ``now()`` or Python's (SQLite); a tick of
the model's clock moves every stored ``due_at``, ``not_after`` and ``finished_at`` back by
``TICK_SECONDS``, which to the library is the same as that much time passing. Debounce periods
and prune ages are 2.5 and 1.5 ticks, so no comparison is ever closer than half a tick (50 s)
and the real seconds an example takes cannot change an answer.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import delete, select, update

from durable_celery import DurableError, SendEvent, current_run, signals
from durable_celery.store.schema import activity, metadata, runs
from tests.model.model import (
    EVENT,
    FINISHED,
    PERIOD,
    PRUNE_AGE,
    PRUNE_RULES,
    UNFINISHED,
    Expect,
    KeyModel,
    Ref,
)

pytestmark = [pytest.mark.model, pytest.mark.timeout(3600)]

TICK_SECONDS = 100.0
TIMEOUT_TICKS = 4  # the debounce timeout, when there is one
REUSES = ("after_close", "after_failure", "never")
DEBOUNCES = ("off", "period", "period+timeout")
DEFAULTS = ("use_existing", "error", "cancel_existing", "run_again", "send_event")
# Every workflow definition the library accepts (run_again with reuse="never" it refuses).
CONFIGS = [
    (reuse, debounce, default)
    for reuse in REUSES
    for debounce in DEBOUNCES
    for default in DEFAULTS
    if not (reuse == "never" and default == "run_again")
]
KEYS = ("a", "b")
# The signals checked, and the arguments compared.
SIGNALS = {
    signals.run_started: ("run_id", "key"),
    signals.run_finished: ("run_id", "status"),
    signals.key_duplicate: ("run_id", "key", "outcome"),
    signals.key_handoff: ("run_id", "key", "previous_id"),
    signals.key_release: ("run_id", "key", "by"),
}


def policy_arg(policy: str | None) -> Any:
    return SendEvent(EVENT) if policy == "send_event" else policy


def add_steps(wf: Any, plans: dict[str, str], during: dict[str, Any]) -> None:
    """Steps ``first`` (compensated by ``undo_first``) and ``second``, which do what the test
    planned for their run: succeed, fail, or (``second``) wait for the event; ``during`` is
    called first, while the step runs."""

    def behave(v: int) -> None:
        run_id = current_run().id
        if run_id in during:
            during.pop(run_id)()
        if plans[run_id] == "fail":
            raise RuntimeError(f"told to fail (v={v})")

    def undo_first(v: int) -> None:
        behave(v)

    @wf.step(compensate=undo_first, compensate_retry=1)
    def first(v: int) -> None:
        behave(v)

    @wf.step
    def second(v: int) -> dict[str, Any]:
        behave(v)
        if plans[current_run().id] == "wait":
            return {"event": current_run().wait_for_event(EVENT)}
        return {"v": v}


class Harness:
    """The library and the model side by side; every operation is checked when it returns."""

    PRUNE = {rule: PRUNE_AGE * TICK_SECONDS for rule in PRUNE_RULES}

    def __init__(self, durable: Any) -> None:
        self.durable = durable
        self.plans: dict[str, str] = {}  # run id -> what its next step (or compensation) does
        self.during: dict[str, Any] = {}  # run id -> what its next step does while it runs
        self.nested_error: BaseException | None = None
        self.workflows: dict[tuple[str, str, str], Any] = {}
        self.sent: list[tuple[Any, ...]] = []  # signals of ours, as (name, run id, ...)
        self._receivers = []
        for signal, fields in SIGNALS.items():
            receiver = self._receiver(signal.name.removeprefix("durable_"), fields)
            signal.connect(receiver, weak=False)
            self._receivers.append((signal, receiver))
        self.outbox = durable.outbox  # a RecordingOutbox: the step messages sent, as run ids

    def _receiver(self, name: str, fields: tuple[str, ...]) -> Any:
        def receive(sender: Any, **kwargs: Any) -> None:
            if sender is self.durable:
                self.sent.append((name, *(kwargs[f] for f in fields)))

        return receive

    def close(self) -> None:
        for signal, receiver in self._receivers:
            signal.disconnect(receiver)

    # -- set-up -----------------------------------------------------------------------------

    def reset(self, reuse: str = "after_close", debounce: str = "off", default: str = "use_existing") -> None:
        """A fresh example: empty tables, a fresh model, the workflow of this configuration."""
        self.wf = self._workflow(reuse, debounce, default)
        with self.durable.db.begin() as conn:
            for table in reversed(metadata.sorted_tables):
                conn.execute(delete(table))
        timeout = TIMEOUT_TICKS if debounce == "period+timeout" else None
        self.model = KeyModel(reuse, timeout, debounce != "off", default)
        self.ids: list[str] = []
        self.last_activity = 0
        self.history: list[dict[str, Any]] = []  # every activity entry expected so far
        self.finished: dict[int, str] = {}  # runs by number -> their finished status
        self.sent.clear()
        self.check()

    def _workflow(self, reuse: str, debounce: str, default: str) -> Any:
        config = (reuse, debounce, default)
        if config in self.workflows:
            return self.workflows[config]
        options: dict[str, Any] = {"reuse": reuse, "on_duplicate": policy_arg(default)}
        if debounce != "off":
            options["debounce"] = {"period": PERIOD * TICK_SECONDS}
            if debounce == "period+timeout":
                options["debounce"]["timeout"] = TIMEOUT_TICKS * TICK_SECONDS
        wf = self.durable.workflow(f"m_{reuse}_{debounce.replace('+', '_')}_{default}", **options)
        add_steps(wf, self.plans, self.during)
        self.workflows[config] = wf
        return wf

    # -- operations (run numbers are the model's: the order runs were created in) -------------

    def start(self, key: str | None, v: int, policy: str | None = None) -> None:
        woken = self._woken()
        expect = self.model.start(key, {"v": v}, policy)
        self.outbox.clear()
        got = self._call(self.durable.start, self.wf, {"v": v}, key=key, on_duplicate=policy_arg(policy))
        self._settle(expect, got)
        self._check_published(expect, woken)

    def work(self, run: int, outcome: str, during: tuple[Any, ...] | None = None) -> None:
        """A worker runs the run's current step (or compensation) with ``outcome``; ``during``
        is an operation made from inside the step while it runs (the run is claimed then):
        ``("start", v, policy)`` with the run's key, ``("cancel",)`` of the run, or
        ``("send_event", v, buffer)`` to the run."""
        model_run, run_id = self.model.runs[run], self.ids[run]
        compensate = model_run.status == "compensating"
        step = 0 if compensate else model_run.stage
        expect = self.model.claim(run)
        self.plans[run_id] = outcome
        if during is not None:
            self.during[run_id] = lambda: self._during(run, during)
        self.nested_error = None
        try:
            status = self.durable.run_message(self.wf.name, step, run_id, compensate=compensate)
        finally:
            self.plans.pop(run_id, None)
            self.during.pop(run_id, None)
        if self.nested_error is not None:
            raise self.nested_error
        if expect.returns == "ran":
            expect.activity += self.model.finish(run, outcome).activity
        self._settle(expect, ("returns", "dropped" if status == "dropped" else "ran"))

    def _during(self, run: int, during: tuple[Any, ...]) -> None:
        """The operation a step makes while it runs; a failed check is raised after the step
        (inside it, the engine would take it for the step's own failure)."""
        name, *args = during
        try:
            if name == "start":
                self.start(self.model.runs[run].key, *args)
            elif name == "cancel":
                self.cancel(run)
            else:
                self.send_event(run, EVENT, *args)
        except BaseException as exc:
            self.nested_error = exc

    def cancel(self, run: int) -> None:
        self._settle(self.model.cancel(run), self._call(self.durable.cancel, self.ids[run]))

    def retry(self, run: int) -> None:
        self._settle(self.model.retry(run), self._call(self.durable.retry, self.ids[run]))

    def rerun(self, run: int) -> None:
        expect = self.model.rerun(run)
        self.outbox.clear()
        self._settle(expect, self._call(self.durable.rerun, self.ids[run]))
        self._check_published(expect, set())

    def _woken(self) -> set[int]:
        """Runs parked on the event and not yet due: a SendEvent start sends them to a worker."""
        return {r.index for r in self.model.runs if r.status == "waiting" and r.wait_name and r.due is None}

    def _check_published(self, expect: Expect, parked: set[int]) -> None:
        """docs/keys.md: a start answered by a holder sends nothing to the broker (a SendEvent
        start sends the holder it wakes); a new run goes out unless it waits (debounce,
        run_again)."""
        sent = [r for r in expect.new_runs if self.model.runs[r].due == self.model.now]
        sent += [r for r in parked if self.model.runs[r].due is not None]
        assert sorted(self.outbox.run_ids()) == sorted(self.ids[r] for r in sent), "messages sent differ"

    def release_key(self, run: int) -> None:
        expect = self.model.release_key(run, "ops")
        self._settle(expect, self._call(self.durable.release_key, self.ids[run], by="ops"))

    def send_event(self, run: int, name: str, v: int, buffer: bool) -> None:
        expect = self.model.send_event(run, name, {"v": v}, buffer)
        got = self._call(self.durable.send_event, self.ids[run], name, {"v": v}, buffer=buffer)
        self._settle(expect, got)

    def prune(self) -> None:
        expect = self.model.prune()
        pruned = [rule for rule, n in expect.returns.items() if n]
        self._settle(expect, self._call(self.durable.prune), pruned=pruned)

    def tick(self, ticks: int) -> None:
        """Time passes: every stored due time, debounce cap and finish time moves back."""
        expect = self.model.tick(ticks)
        shift = timedelta(seconds=ticks * TICK_SECONDS)
        columns = (runs.c.due_at, runs.c.not_after, runs.c.finished_at)
        with self.durable.db.begin() as conn:
            for row in conn.execute(select(runs.c.id, *columns)).all():
                moved = {c.name: row._mapping[c.name] - shift for c in columns if row._mapping[c.name]}
                if moved:
                    conn.execute(update(runs).where(runs.c.id == row.id).values(**moved))
        self._settle(expect, ("returns", None))

    # -- checking -----------------------------------------------------------------------------

    @staticmethod
    def _call(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        try:
            return "returns", fn(*args, **kwargs)
        except DurableError as exc:
            return "raises", exc

    def _resolve(self, value: Any) -> Any:
        if isinstance(value, Ref):
            return self.ids[value.index]
        if isinstance(value, dict):
            return {k: self._resolve(v) for k, v in value.items()}
        return value

    def _settle(self, expect: Expect, got: tuple[str, Any], pruned: list[str] | None = None) -> None:
        """Compare the call's answer, bind the runs it created, compare activity and state."""
        how, value = got
        if expect.raises is not None:
            assert how == "raises", f"expected {expect.raises}, got {value!r}"
            assert type(value).__name__ == expect.raises, f"expected {expect.raises}, got {value!r}"
            if expect.holder is not None:
                assert value.holder_id == self.ids[expect.holder], "KeyTaken names another holder"
        else:
            assert how == "returns", f"expected {expect.returns!r}, got {value!r}"
            assert len(expect.new_runs) <= 1
            if expect.new_runs:
                assert expect.returns == Ref(expect.new_runs[0])
                assert isinstance(value, str) and value not in self.ids, f"expected a new run, got {value!r}"
                self.ids.append(value)
            assert value == self._resolve(expect.returns), f"expected {expect.returns!r}, got {value!r}"
        self._check_activity(expect, pruned or [])
        self._check_signals(expect)
        self.check()

    def _check_signals(self, expect: Expect) -> None:
        """One signal per key activity entry, run_started per new run, run_finished per run that
        finished (``durable_celery.signals``)."""
        wanted = [("run_started", self.ids[r], self.model.runs[r].key) for r in expect.new_runs]
        for run in self.model.runs:
            if run.status not in FINISHED:  # a retried run finishes again
                self.finished.pop(run.index, None)
            elif run.index not in self.finished:
                self.finished[run.index] = run.status
                wanted.append(("run_finished", self.ids[run.index], run.status))
        for entry in expect.activity:
            run_id, key, details = self.ids[entry["run"]], entry["key"], self._resolve(entry["details"])
            if entry["kind"] == "key_duplicate":
                wanted.append(("key_duplicate", run_id, key, details["outcome"]))
            elif entry["kind"] == "key_released":
                wanted.append(("key_release", run_id, key, details["by"]))
            elif entry["kind"] in ("cancelled", "retried"):  # run_finished and nothing, above
                continue
            else:  # key_handed_off, key_retaken
                wanted.append(("key_handoff", run_id, key, details["from"]))
        got, self.sent[:] = list(self.sent), []
        assert sorted(got, key=repr) == sorted(wanted, key=repr), "signals differ"

    def _check_activity(self, expect: Expect, pruned: list[str]) -> None:
        with self.durable.db.engine.connect() as conn:
            rows = conn.execute(
                select(activity).where(activity.c.id > self.last_activity).order_by(activity.c.id)
            ).all()
        if rows:
            self.last_activity = rows[-1].id
        name = self.wf.name
        got, pruned_rules = [], []
        for row in rows:
            if row.kind == "runs_pruned":
                pruned_rules.append(row.details["rule"])
                continue
            got.append(_entry(row.kind, row.run_id, row.workflow, row.key, row.details))
        wanted = []
        for entry in expect.activity:
            details = {"key": entry["key"], "workflow": name, **self._resolve(entry["details"])}
            wanted.append(_entry(entry["kind"], self.ids[entry["run"]], name, entry["key"], details))
        assert sorted(got) == sorted(wanted), "activity differs"
        self.history += [{**e, "details": self._resolve(e["details"])} for e in expect.activity]
        assert sorted(pruned_rules) == sorted(pruned), "runs_pruned entries differ"

    def check(self) -> None:
        """Every run and every key of the workflow, as the model has them."""
        model, name = self.model, self.wf.name
        stored = {r.id: r for r in self.durable.list_runs(workflow=name, limit=1000)}
        live = model.live()
        assert sorted(stored) == sorted(self.ids[r.index] for r in live), "the stored runs differ"
        for run in live:
            got = stored[self.ids[run.index]]
            want = {
                "status": run.status,
                "input": run.input,
                "key": run.key,
                "holds_key": model.holds_key(run),
                "runs_after_id": None if run.runs_after is None else self.ids[run.runs_after],
            }
            seen = {field: getattr(got, field) for field in want}
            assert seen == want, f"run {run.index} differs"
            if run.status == "completed":
                assert got.output == run.output, f"run {run.index}'s output differs"
            if run.status == "cancelled":
                assert self._cancel_error(got.error) == self._cancel_error_of(run), f"run {run.index}'s error"
        entries = {e.key: e for e in self.durable.list_keys(workflow=name)}
        assert sorted(entries) == sorted(model.keys), "the held keys differ"
        for key, row in model.keys.items():
            entry, holder = entries[key], model.runs[row.holder]
            want_key = {
                "holder_id": self.ids[row.holder],
                "waiting_id": None if row.waiting is None else self.ids[row.waiting],
                "holder_status": holder.status,
                "blocks": model.blocks(key),
                "runs": sum(1 for r in live if r.key == key),
                "readds_last_day": model.duplicates.get(key, 0),
            }
            seen_key = {field: getattr(entry, field) for field in want_key}
            assert seen_key == want_key, f"key {key!r} differs"
        self._check_stats()

    def _check_stats(self) -> None:
        """``stats.keys()`` as docs/keys.md, "Key statistics", derives it from the entries."""
        model, stats = self.model, self.durable.stats.keys(workflow=self.wf.name)
        dups = [e for e in self.history if e["kind"] == "key_duplicate"]
        kinds = Counter(e["kind"] for e in self.history)
        per_key = Counter(e["key"] for e in dups)
        want = {
            "keys_held": len(model.keys),
            "blocking": sum(model.blocks(k) for k in model.keys),
            "readds": len(dups),
            "readds_by_outcome": dict(Counter(e["details"]["outcome"] for e in dups)),
            "dropped_inputs": sum(
                e["details"]["outcome"] in ("use_existing", "error") and e["details"]["input_changed"]
                for e in dups
            ),
            "handoffs": kinds["key_handed_off"],
            "releases": kinds["key_released"],
            "retakes": kinds["key_retaken"],
            "readds_last_day": len(dups),
            "top_keys": sorted((k, n) for k, n in per_key.items()),
        }
        seen = {k: stats[k] for k in want if k in stats}
        seen["readds_last_day"] = sum(h["count"] for h in stats["readds_over_time"])
        seen["top_keys"] = sorted((t["key"], t["readds"]) for t in stats["top_keys"])
        assert seen == want, "stats.keys() differs"

    @staticmethod
    def _cancel_error(error: dict[str, Any] | None) -> tuple[Any, ...]:
        error = error or {}
        return error.get("message"), error.get("replaced_by")

    def _cancel_error_of(self, run: Any) -> tuple[Any, ...]:
        why = run.error
        if why[0] == "replaced":  # docs/keys.md, cancel_existing
            new_id = self.ids[why[1]]
            return f"replaced by run {new_id}", new_id
        if why[0] == "kept":  # docs/keys.md, run_again under after_failure
            return f"run {self.ids[why[1]]} {why[2]} and reuse={self.model.reuse!r} keeps the key", None
        return "cancelled", None


def _entry(kind: str, run_id: str | None, workflow: str | None, key: str | None, details: Any) -> str:
    return json.dumps([kind, run_id, workflow, key, details], sort_keys=True)


# -- the state machine ------------------------------------------------------------------------

RUN = st.integers(0, 11)  # a run by number, taken modulo the runs there are (see KeyMachine.pick)
OUTCOME = st.sampled_from(("ok", "fail", "wait"))
# Mostly nothing; else a start with the run's key, a cancel of it, or an event sent to it.
DURING = st.one_of(
    st.none(),
    st.none(),
    st.none(),
    st.tuples(st.just("start"), st.integers(0, 2), st.sampled_from((None, *DEFAULTS))),
    st.just(("cancel",)),
    st.tuples(st.just("send_event"), st.integers(0, 2), st.booleans()),
)


# What each operation draws besides its name.
ARGUMENTS = {
    "start": (st.sampled_from((*KEYS, None)), st.integers(0, 2), st.sampled_from((None, *DEFAULTS))),
    "work": (RUN, OUTCOME, DURING),
    "cancel": (RUN,),
    "send_event": (RUN, st.sampled_from((EVENT, "other")), st.integers(0, 2), st.booleans()),
    "retry": (RUN,),
    "rerun": (RUN,),
    "release_key": (RUN,),
    "tick": (st.integers(1, 3), st.booleans()),  # ticks, and whether to prune then
}
# One rule draws the operation, so every example mixes them all (hypothesis would otherwise
# switch whole rules off in some examples); repeated names weigh starts and worker passes up.
WEIGHTED = (
    ("start",) * 5 + ("work",) * 6 + ("tick",) * 2 + ("cancel", "send_event", "retry", "rerun", "release_key")
)
OPERATIONS = st.sampled_from(WEIGHTED).flatmap(lambda name: st.tuples(st.just(name), *ARGUMENTS[name]))


def claimable(run: Any, model: KeyModel) -> bool:
    return model.claimable(run, run.status == "compensating")


def going(run: Any) -> bool:
    return run.status in UNFINISHED


def finished(run: Any) -> bool:
    return run.status not in UNFINISHED and not run.pruned


def failed(run: Any) -> bool:
    return run.status == "failed"


# Which runs an operation mostly picks: those it can do something with.
PREFER = {"work": claimable, "cancel": going, "send_event": going, "retry": failed, "rerun": finished}
PREFER["release_key"] = finished


class KeyMachine(RuleBasedStateMachine):
    """Random sequences of operations on one workflow's keys; the harness checks every step.

    Each step is noted as the harness call it makes (``h.start('a', 0, None)``, ...), so a
    failing example prints as a script to paste into test_key_model_regressions.py.
    """

    harness: Harness  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.h = type(self).harness

    def pick(self, run: int, op: str) -> int:
        """Run ``run`` modulo the runs there are; three times in four among the runs ``op``
        prefers, when there are any."""
        runs = self.h.model.runs
        prefer = PREFER[op]
        if prefer is claimable:
            chosen = [r.index for r in runs if claimable(r, self.h.model)]
        else:
            chosen = [r.index for r in runs if prefer(r)]
        if chosen and run % 4:
            return chosen[run % len(chosen)]
        return run % len(runs)

    @initialize(config=st.sampled_from(CONFIGS + [c for c in CONFIGS if c[1] == "off"]))  # half undebounced
    def setup(self, config: tuple[str, str, str]) -> None:
        note(f"h.reset{config!r}")
        self.h.reset(*config)

    @rule(op=OPERATIONS)
    def act(self, op: tuple[Any, ...]) -> None:
        name, *args = op
        if name == "tick":
            ticks, prune = args
            self._do("tick", ticks)
            if prune:
                self._do("prune")
            return
        if name != "start":
            if not self.h.model.runs:
                return
            args[0] = self.pick(args[0], name)
        self._do(name, *args)

    def _do(self, name: str, *args: Any) -> None:
        note(f"h.{name}({', '.join(map(repr, args))})")
        getattr(self.h, name)(*args)


def test_key_table_matches_the_model(harness: Harness, model_settings: Any) -> None:
    """Random sequences on PostgreSQL and on SQLite agree with the key guide's model."""
    machine = type("KeyMachineRun", (KeyMachine,), {"harness": harness})
    run_state_machine_as_test(machine, settings=model_settings)
