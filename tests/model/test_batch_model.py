"""Batches, model-checked: hypothesis drives the real library with random sequences of starts
over three batch keys, a batch's period running out, worker passes and cancels, on PostgreSQL,
the SQLite file and testing.Fake, and after every operation compares each run with a small
model of the batch rules (docs/flow-control.md, "Batches"):

- a start joins its key's open batch (the same run id) while that batch has fewer than ``MAX``
  starts, its period has not run out and its run has neither begun nor been cancelled; else it
  opens the next batch (a new run);
- the ``MAX``-th start makes the run due at once; a run whose period ran out is due; a run not
  due is not claimed by a worker pass;
- every start's input is in exactly one run, in start order, and a run holds at most ``MAX``.

A period running out is done to the store (the batch's ``closes_at`` and its run's ``due_at``
moved into the past, as the clock would), the same on every backend.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from sqlalchemy import delete, update

from durable_celery.store.schema import batches, runs
from durable_celery.testing import RecordingOutbox

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

MAX = 3
KEYS = st.sampled_from(["a", "b", "c"])


@pytest.fixture(params=["postgres", "sqlite", "fake"])
def backend(request: pytest.FixtureRequest) -> str:
    """The model runs against both backends and testing.Fake."""
    return str(request.param)


class BatchMachine(RuleBasedStateMachine):
    durable: Any = None

    @initialize()
    def reset(self) -> None:
        d = self.durable
        with d.db.begin() as conn:
            conn.execute(delete(batches))
            conn.execute(delete(runs))
        self.n = 0
        self.open: dict[str, str] = {}  # batch key -> the run gathering it
        self.model: dict[str, dict[str, Any]] = {}  # run id -> key, items, state

    @rule(key=KEYS)
    def start(self, key: str) -> None:
        self.n += 1
        run_id = self.durable.start("lines", {"k": key, "n": self.n})
        joined = self.open.get(key)
        if joined is not None:
            assert run_id == joined, f"start {self.n} of {key} opened {run_id}, not joining {joined}"
            entry = self.model[run_id]
            entry["items"].append(self.n)
            if len(entry["items"]) == MAX:
                entry["state"] = "due"
                del self.open[key]
        else:
            assert run_id not in self.model, f"start {self.n} of {key} joined {run_id}, which is closed"
            self.model[run_id] = {"key": key, "items": [self.n], "state": "gathering"}
            self.open[key] = run_id

    @rule(key=KEYS)
    def period_runs_out(self, key: str) -> None:
        run_id = self.open.pop(key, None)
        if run_id is None:
            return
        past = self.durable.db.utcnow() - timedelta(seconds=1)
        with self.durable.db.begin() as conn:
            conn.execute(update(batches).where(batches.c.run_id == run_id).values(closes_at=past))
            conn.execute(update(runs).where(runs.c.id == run_id).values(due_at=past))
        self.model[run_id]["state"] = "due"

    @rule(data=st.data())
    def work(self, data: st.DataObject) -> None:
        if not self.model:
            return
        run_id = data.draw(st.sampled_from(sorted(self.model)))
        entry = self.model[run_id]
        got = self.durable.run_message("lines", 0, run_id)
        if entry["state"] == "due":
            assert got == "completed", f"a due run's pass: {got}"
            entry["state"] = "completed"
        else:
            assert got != "completed", f"a {entry['state']} run's pass completed it"

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        if not self.model:
            return
        run_id = data.draw(st.sampled_from(sorted(self.model)))
        entry = self.model[run_id]
        self.durable.cancel(run_id)
        if entry["state"] in ("gathering", "due"):
            entry["state"] = "cancelled"
            if self.open.get(entry["key"]) == run_id:
                del self.open[entry["key"]]

    @invariant()
    def runs_match_the_model(self) -> None:
        if not hasattr(self, "model"):
            return
        stored = {run.id: run for run in self.durable.list_runs(limit=1000)}
        assert set(stored) == set(self.model)
        everything = []
        for run_id, entry in self.model.items():
            run = stored[run_id]
            items = [item["n"] for item in run.input["items"]]
            assert items == entry["items"], f"run {run_id}: items {items}, the model {entry['items']}"
            assert {item["k"] for item in run.input["items"]} == {entry["key"]}
            assert len(items) <= MAX
            status = {"gathering": "pending", "due": "pending"}.get(entry["state"], entry["state"])
            assert run.status == status, f"run {run_id}: {run.status}, the model {entry['state']}"
            if status == "completed":
                assert run.output == sum(items)
            everything.extend(items)
        assert sorted(everything) == list(range(1, self.n + 1))  # each start in exactly one run


def test_batches_follow_the_model(make_durable: Any, model_settings: Any) -> None:
    """Random starts, periods running out, worker passes and cancels keep the batch rules."""
    durable = make_durable(broker_url="memory://", upkeep=False, outbox=RecordingOutbox())
    wf = durable.workflow("lines", batch={"max": MAX, "period": 3600, "key": "{k}"})
    wf.step(lambda items: sum(item["n"] for item in items), name="handle")
    machine = type("BatchMachineRun", (BatchMachine,), {"durable": durable})
    run_state_machine_as_test(machine, settings=model_settings)
