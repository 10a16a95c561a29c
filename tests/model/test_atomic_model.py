"""Atomic steps, model-checked: hypothesis drives the real library on PostgreSQL with random
sequences of starts, worker passes, cancels and retries of a workflow whose last step books a
ledger row and adds to a balance in an atomic step, and after every operation checks that each
completed run has booked exactly once and every other run never, and that the balance is the sum
of the completed runs' amounts.

Workflow ``pay``: ``reserve`` (a plain step, no writes) then ``book`` (``atomic=True``: inserts
into ``model_ledger`` and updates ``model_balance``, on ``current_run().connection`` or through
``current_run().session()``). A worker pass is ``durable.run_message`` in the test's thread, with
what the step does chosen by the machine: how it writes, raise before or after its writes, and
while it runs (after its writes) have its run taken over by the real stale sweep
(``sweeps.sweep_stale_once`` once its heartbeat is made old: the fence moves, losses count, and
the run fails with ``WorkerLost`` after ``MAX_LOSSES``), cancelled, or start a run of its own
(which joins the step's transaction: it exists only if the step commits).

Compared after every operation, with a small model of the run rules (docs/getting-started.md,
"Steps that write your database"; docs/reliability.md): what ``run_message`` returned, every
run's status, step, attempt and losses, and the ledger: one row per completed run (written by
its last attempt), none for a run that failed, was cancelled or is unfinished, the balance equal
to the completed runs' amounts, one completed ``book`` step row per completed run.

The twin (``atomic=False``: ``book`` writes in a transaction of its own) runs the same machine
and must fail that check: a pass that raised, or was taken over or cancelled, after its writes
leaves a booking behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import Phase, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from sqlalchemy import Column, Integer, MetaData, String, Table, delete, func, insert, select, update
from sqlalchemy.orm import registry

from durable_celery import current_run
from durable_celery.core.sweeps import sweep_stale_once
from durable_celery.store.schema import metadata, runs, steps
from durable_celery.testing import RecordingOutbox

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

RETRY = 2  # attempts of each step
MAX_LOSSES = 2  # a second take-over during one step fails the run with WorkerLost
STALE = 120.0  # stale_lock_timeout; heartbeats 30 s apart never come during a step here
UNFINISHED = ("pending", "running")

meta = MetaData()
ledger = Table(
    "model_ledger",
    meta,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", String(64), nullable=False),
    Column("amount", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
)
balance = Table("model_balance", meta, Column("id", Integer, primary_key=True), Column("total", Integer))


class Entry:
    """A ledger row, mapped for the steps that write through ``current_run().session()``."""

    def __init__(self, **values: Any) -> None:
        """An entry with these column values."""
        for name, value in values.items():
            setattr(self, name, value)


registry().map_imperatively(Entry, ledger)


@pytest.fixture(params=["postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    """Atomic steps need PostgreSQL (Capability.ATOMIC_STEPS)."""
    return str(request.param)


@dataclass
class Plan:
    """What the next pass of a step does: ``write`` (``conn`` or ``session``; ``book`` only), raise
    (``before`` or ``after`` its writes, or ``no``), and ``during`` (``take_over``, ``cancel``,
    ``start`` or None) after its writes."""

    write: str = "conn"
    raises: str = "no"
    during: str | None = None


@dataclass
class ModelRun:
    """A run as the rules have it."""

    amount: int
    status: str = "pending"
    stage: int = 0
    attempt: int = 1
    base: int = 0  # attempt_base: attempts before the last retry
    losses: int = 0


class Harness:
    """The library, its model, and the checks after every operation. With ``atomic=False``
    (the twin that shows the checks can fail) ``book`` is a plain step that writes in a
    transaction of its own, committed before the step goes on."""

    def __init__(self, durable: Any, atomic: bool = True) -> None:
        """The workflow ``pay`` on ``durable``."""
        self.durable = durable
        self.atomic = atomic
        self.plans: dict[str, Plan] = {}
        self.started_inside: list[str] = []  # run ids started by a step, in this pass
        self.wf = durable.workflow("pay")
        self.wf.step(self._reserve, name="reserve", retry=RETRY, backoff=0.001)
        self.wf.step(self._book, name="book", retry=RETRY, backoff=0.001, atomic=atomic)

    def reset(self) -> None:
        """Empty every table, the balance at 0; no runs."""
        with self.durable.db.begin() as conn:
            for table in reversed(metadata.sorted_tables):
                conn.execute(delete(table))
            conn.execute(delete(ledger))
            conn.execute(delete(balance))
            conn.execute(insert(balance).values(id=1, total=0))
        self.ids: list[str] = []
        self.model: list[ModelRun] = []
        self.check()

    # -- the steps --------------------------------------------------------------------------

    def _reserve(self, amount: int) -> None:
        """The first step: no writes."""
        self._behave(None)

    def _book(self, amount: int) -> dict[str, int]:
        """The booking step."""
        self._behave(amount)
        return {"booked": amount}

    def _behave(self, amount: int | None) -> None:
        """What the step's plan says: raise before, write (``book``), act during, raise after."""
        run = current_run()
        plan = self.plans.pop(run.id, Plan())
        if plan.raises == "before":
            raise RuntimeError("told to fail before writing")
        if amount is not None and not self.atomic:
            with self.durable.db.begin() as conn:  # the twin's own transaction, committed here
                conn.execute(insert(ledger).values(run_id=run.id, amount=amount, attempt=run.attempt))
                conn.execute(update(balance).values(total=balance.c.total + amount))
        elif amount is not None and plan.write == "conn":
            run.connection.execute(insert(ledger).values(run_id=run.id, amount=amount, attempt=run.attempt))
            run.connection.execute(update(balance).values(total=balance.c.total + amount))
        elif amount is not None and plan.write == "session":
            session = run.session()
            session.add(Entry(run_id=run.id, amount=amount, attempt=run.attempt))
            session.execute(update(balance).values(total=balance.c.total + amount))
            session.commit()  # commits nothing of the step's transaction
        if plan.during == "take_over":
            self._take_over(run.id)
        elif plan.during == "cancel":
            assert self.durable.cancel(run.id) is True
        elif plan.during == "start":
            self.started_inside.append(self.durable.start(self.wf, {"amount": 1000}))
        if plan.raises == "after":
            raise RuntimeError("told to fail after writing")

    def _take_over(self, run_id: str) -> None:
        """What a stale sweep in another worker does to a run whose worker froze: its heartbeat
        is made older than ``stale_lock_timeout`` and the real sweep takes it back."""
        with self.durable.db.begin() as conn:
            old = func.now() - timedelta(seconds=STALE + 10)
            conn.execute(update(runs).where(runs.c.id == run_id).values(heartbeat_at=old))
        handed_back, failed = sweep_stale_once(self.durable.runtime)
        assert handed_back + failed == [run_id]

    # -- operations -------------------------------------------------------------------------

    def start(self, amount: int) -> None:
        """Start a run that books ``amount``."""
        self.ids.append(self.durable.start(self.wf, {"amount": amount}))
        self.model.append(ModelRun(amount))
        self.check()

    def work(self, run: int, write: str, raises: str, during: str | None) -> None:
        """A worker runs the run's current step with this plan (``run_message``)."""
        run_id, m = self.ids[run], self.model[run]
        self.plans[run_id] = Plan(write, raises, during)
        self.started_inside = []
        atomic = m.stage == 1 and self.atomic
        with self.durable.db.begin() as conn:  # a retry's back-off is over: time passes, as for a worker
            due = runs.c.id == run_id, runs.c.due_at > func.now()
            conn.execute(update(runs).where(*due).values(due_at=func.now()))
        got = self.durable.run_message("pay", min(m.stage, 1), run_id)  # a finished run: its last step
        self.plans.pop(run_id, None)
        assert got == self._expect(m, raises, during), f"run {run} returned {got}"
        # A start inside the atomic step joins its transaction: it exists if the step committed.
        # Inside the plain step it commits at once, whatever becomes of the step.
        for started in self.started_inside:
            if got == "completed" or not atomic:
                self.ids.append(started)
                self.model.append(ModelRun(1000))
        self.check()

    def _expect(self, m: ModelRun, raises: str, during: str | None) -> str:
        """What a pass comes to by the rules, with the model moved on."""
        if m.status not in UNFINISHED:
            return "dropped"
        m.status = "running"
        if raises == "before":  # nothing else happens in the step
            during = None
        if during == "take_over":
            m.losses += 1
            if m.losses >= MAX_LOSSES:
                m.status = "failed"
            return "fenced"
        if during == "cancel":
            m.status = "cancelled"
            return "cancelled"
        m.losses = 0
        if raises != "no":
            if m.attempt - m.base < RETRY:
                m.attempt += 1
                return "retrying"
            m.status = "failed"
            return "failed"
        m.stage += 1
        if m.stage == 2:  # the run completes: its attempt stays the one that booked
            m.status = "completed"
            return "completed"
        m.attempt, m.base = 1, 0
        return "running"

    def cancel(self, run: int) -> None:
        """Cancel a run: True while it is unfinished."""
        m = self.model[run]
        want = m.status in UNFINISHED
        assert self.durable.cancel(self.ids[run]) is want
        if want:
            m.status = "cancelled"
        self.check()

    def retry(self, run: int) -> None:
        """Retry a failed run from its failed step (nothing for another)."""
        m = self.model[run]
        if m.status != "failed":
            return
        self.durable.retry(self.ids[run])
        m.status, m.base, m.attempt, m.losses = "running", m.attempt, m.attempt + 1, 0
        self.check()

    # -- the invariant ----------------------------------------------------------------------

    def check(self) -> None:
        """Runs as the model has them; one ledger row per completed run and none for another;
        the balance is the completed runs' amounts; one completed book row per completed run."""
        with self.durable.db.engine.connect() as conn:
            got = {
                row.id: (row.status, row.step_index, row.attempt, row.losses)
                for row in conn.execute(
                    select(runs.c.id, runs.c.status, runs.c.step_index, runs.c.attempt, runs.c.losses)
                )
            }
            rows = conn.execute(select(ledger.c.run_id, ledger.c.amount, ledger.c.attempt)).all()
            (total,) = conn.execute(select(balance.c.total)).one()
            booked = conn.execute(
                select(steps.c.run_id, steps.c.attempt).where(
                    steps.c.step_index == 1, steps.c.phase == "step", steps.c.status == "completed"
                )
            ).all()
        want = {
            self.ids[i]: (m.status, min(m.stage, 1), m.attempt, m.losses) for i, m in enumerate(self.model)
        }
        assert got == want, "runs differ from the model"
        completed = {self.ids[i]: m for i, m in enumerate(self.model) if m.status == "completed"}
        assert sorted(r.run_id for r in rows) == sorted(completed), (
            "ledger rows are not one per completed run"
        )
        assert sorted(r.run_id for r in booked) == sorted(completed), (
            "book rows are not one per completed run"
        )
        attempts = {r.run_id: r.attempt for r in booked}
        for row in rows:
            assert row.amount == completed[row.run_id].amount
            assert row.attempt == attempts[row.run_id], "the booking is not the completed attempt's"
        assert total == sum(m.amount for m in completed.values()), "the balance is not the sum of bookings"


WRITES = st.sampled_from(("conn", "conn", "session"))
RAISES = st.sampled_from(("no", "no", "no", "no", "before", "after", "after"))
DURING = st.sampled_from((None, None, None, None, None, "take_over", "take_over", "cancel", "start"))
RUN = st.integers(0, 11)  # a run by number, taken modulo the runs there are (AtomicMachine.pick)
ARGUMENTS = {
    "start": (st.integers(1, 99),),
    "work": (RUN, WRITES, RAISES, DURING),
    "cancel": (RUN,),
    "retry": (RUN,),
}
# One rule draws the operation, so every example mixes them; worker passes weigh most.
WEIGHTED = ("start",) * 3 + ("work",) * 8 + ("cancel", "retry")
OPERATIONS = st.sampled_from(WEIGHTED).flatmap(lambda name: st.tuples(st.just(name), *ARGUMENTS[name]))
PREFER = {"work": UNFINISHED, "cancel": UNFINISHED, "retry": ("failed",)}


class AtomicMachine(RuleBasedStateMachine):
    """Random sequences of starts, worker passes, cancels and retries; each step is noted as
    the harness call it makes (``h.work(0, 'conn', 'after', 'take_over')``, ...), so a failing
    example prints as a script to replay."""

    harness: Harness  # set by the test

    def __init__(self) -> None:
        """The machine drives the harness its test class names."""
        super().__init__()
        self.h = type(self).harness

    @initialize()
    def setup(self) -> None:
        """Each example starts from empty tables."""
        note("h.reset()")
        self.h.reset()

    def pick(self, n: int, op: str) -> int:
        """Run ``n`` modulo the runs there are; three times in four among those ``op`` prefers."""
        model = self.h.model
        chosen = [i for i, m in enumerate(model) if m.status in PREFER[op]]
        return chosen[n % len(chosen)] if chosen and n % 4 else n % len(model)

    @rule(op=OPERATIONS)
    def act(self, op: tuple[Any, ...]) -> None:
        """One operation, noted as the harness call it makes."""
        name, *args = op
        if name != "start":
            if not self.h.model:
                return
            args[0] = self.pick(args[0], name)
        note(f"h.{name}({', '.join(map(repr, args))})")
        getattr(self.h, name)(*args)


def _harness(make_durable: Any, atomic: bool) -> Harness:
    """A Harness on its own Durable, with the ledger tables."""
    values = {
        "heartbeat_interval": 30.0,
        "stale_lock_timeout": STALE,
        "max_losses": MAX_LOSSES,
        "publish_in_background": False,
    }
    durable = make_durable(broker_url="memory://", upkeep=False, outbox=RecordingOutbox(), **values)
    with psycopg.connect(durable.db.url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("ALTER DATABASE " + conn.info.dbname + " SET synchronous_commit = off")
    durable.db.dispose()
    with durable.db.begin() as conn:
        meta.create_all(conn)
    return Harness(durable, atomic)


@pytest.fixture
def atomic_harness(make_durable: Any) -> Harness:
    """The harness of the atomic workflow."""
    return _harness(make_durable, atomic=True)


@pytest.fixture
def plain_harness(make_durable: Any) -> Harness:
    """The harness of its twin, ``book`` without ``atomic``."""
    return _harness(make_durable, atomic=False)


def test_atomic_bookings_happen_once_per_completed_run(atomic_harness: Harness, model_settings: Any) -> None:
    """Random sequences of passes that raise, are taken over or cancelled mid-step, retries
    and cancels: the ledger always holds exactly the completed runs' bookings."""
    machine = type("AtomicMachineRun", (AtomicMachine,), {"harness": atomic_harness})
    run_state_machine_as_test(machine, settings=model_settings)


def test_without_atomic_the_same_sequences_book_twice(plain_harness: Harness, model_settings: Any) -> None:
    """The twin: the same machine with ``book`` not atomic soon finds a ledger that is not one
    booking per completed run (a pass that raised, or was taken over or cancelled, after its
    writes): the invariant can fail. Found, not shrunk: the first failing example will do."""
    machine = type("PlainMachineRun", (AtomicMachine,), {"harness": plain_harness})
    quick = settings(model_settings, phases=[Phase.generate])
    with pytest.raises(AssertionError, match="ledger rows are not one per completed run|the balance is not"):
        run_state_machine_as_test(machine, settings=quick)
