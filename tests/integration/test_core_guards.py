"""Guards of the core that deliberate one-line breaks used to slip past (issue 16).

- **Fencing while the new holder is inside the step.** A worker whose lock went stale wakes up
  (returns, fails, heartbeats, snoozes or waits) while the worker that took the run over is still
  running the same step. The run's status is ``running`` then, so only the fencing token can
  refuse the stale worker: it records nothing, is stopped, and the new holder's result is the
  run's. (When the new holder has already finished, the status check refuses the stale worker
  too, which is all the older tests looked at.) Real worker threads; events order everything.
- **``KeyContended`` after exactly ``MAX_HANDS`` hand changes, and not before**, in a start and
  in a retry. Another transaction deleting and re-inserting the key row at exactly the moment
  between the start's statements is played by wrapping ``key_rows.lock_key_txn``.
- **A debounced holder that a worker has started** is not folded into: that
  ``KeyDecision._duplicate`` computes ``unclaimed`` with ``holder.started_at is None`` is
  redundant, so dropping it is an *equivalent* change, for two reasons. (1) Every use of
  ``unclaimed`` is ``unclaimed and self._take_input(...)``, whose ``UPDATE`` matches only
  ``status = 'pending' AND started_at IS NULL``: for a started holder it changes nothing and
  returns False, and the start goes on exactly as if ``unclaimed`` were False. (2) No run is
  ``pending`` once started anyway: a claim makes it ``running``, and ``retry`` puts a started run
  back as ``running`` (``pending`` only if it never started). The test below still pins the
  behaviour (a start against a started, retried debounced holder is a plain duplicate).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import delete, insert, select, update

from durable_celery import KeyContended, KeyTaken, current_run, signals
from durable_celery.errors import RunStopped
from durable_celery.store import key_rows
from durable_celery.store.schema import keys, runs
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(60)

WAIT = 15.0  # seconds any one event may take, on a loaded machine


def _wait(event: threading.Event, what: str) -> None:
    if not event.wait(WAIT):
        raise AssertionError(f"timed out waiting for {what}")


# -- fencing: the stale worker wakes while the new holder is mid-step --------------------------------


class TakeOver:
    """One step run twice at once: the first (stale) execution blocks until released; the sweep
    hands the run to a second execution, which blocks inside the step until released too."""

    def __init__(self, durable: Any, action: str) -> None:
        self.durable = durable
        self.action = action
        self.stale_inside = threading.Event()
        self.new_inside = threading.Event()
        self.release_stale = threading.Event()
        self.release_new = threading.Event()
        self.stale_done = threading.Event()  # the stale execution's outcome is settled
        self.seen: list[str] = []  # what the stale execution went through
        self.calls = 0
        self.lock = threading.Lock()
        self.run_id = ""

    def step(self) -> str:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            return self._stale()
        return self._new()

    def _stale(self) -> str:
        self.stale_inside.set()
        # Blocks without a heartbeat (heartbeat_interval is long): its lock goes stale.
        _wait(self.release_stale, "the test to wake the stale worker")
        run = current_run()
        try:
            if self.action == "raises":
                raise ValueError("the stale worker's failure")
            if self.action == "heartbeats":
                run.heartbeat()
            elif self.action == "snoozes":
                run.snooze(30, "stale")
            elif self.action == "waits":
                run.wait_for_event("never")
        except RunStopped as exc:
            self.seen.append(f"stopped:{exc.reason}")
            raise
        self.seen.append("went on")
        return "stale worker"

    def _new(self) -> str:
        self.new_inside.set()
        while not self.release_new.wait(0.05):
            current_run().heartbeat()  # the new holder keeps its own lock fresh meanwhile
        return "new worker"

    def on_fenced(self, sender: Any, run_id: str, **kw: Any) -> None:
        if run_id == self.run_id:
            self.seen.append("fenced")
            self.stale_done.set()


@contextmanager
def take_over(make_durable: Any, action: str) -> Iterator[TakeOver]:
    # No heartbeats unless a step asks for one, and a lock stale after half a second: the sweep
    # of the worker's own upkeep hands the run to the worker's second thread.
    durable = make_durable(heartbeat_interval=60, stale_lock_timeout=0.5, sweep_interval=0.1)
    scene = TakeOver(durable, action)
    wf = durable.workflow("taken_over")
    wf.step(retry=3)(scene.step)
    signals.worker_fenced.connect(scene.on_fenced, weak=False)
    try:
        with worker(durable, concurrency=2):
            scene.run_id = durable.start(wf)
            try:
                yield scene
            finally:  # let both executions end whatever the test saw
                scene.release_stale.set()
                scene.release_new.set()
    finally:
        signals.worker_fenced.disconnect(scene.on_fenced)


def _locked_by(durable: Any, run_id: str) -> tuple[str | None, int]:
    with durable.db.engine.connect() as conn:
        row = conn.execute(select(runs.c.locked_by, runs.c.fence).where(runs.c.id == run_id)).one()
    return row.locked_by, row.fence


@pytest.mark.parametrize("action", ["returns", "raises", "heartbeats", "snoozes", "waits"])
def test_stale_worker_waking_while_the_new_holder_is_mid_step_is_fenced_out(make_durable, action):
    with take_over(make_durable, action) as scene:
        durable = scene.durable
        _wait(scene.stale_inside, "the first execution to start")
        _wait(scene.new_inside, "the sweep to hand the run to the second execution")
        holder_before = _locked_by(durable, scene.run_id)
        assert durable.get_run(scene.run_id).status == "running"

        scene.release_stale.set()
        _wait(scene.stale_done, f"the stale worker ({action}) to be fenced out")

        # It recorded nothing and changed nothing: the new holder still has the run.
        assert durable.list_steps(scene.run_id) == []
        assert _locked_by(durable, scene.run_id) == holder_before
        run = durable.get_run(scene.run_id)
        assert (run.status, run.attempt, run.error) == ("running", 1, None)
        if action == "heartbeats":  # stopped at its heartbeat, inside the step
            assert scene.seen == ["stopped:fenced", "fenced"]
        elif action in ("returns", "raises"):
            assert scene.seen == (["went on", "fenced"] if action == "returns" else ["fenced"])
        kinds = [a.kind for a in durable.activity(run_id=scene.run_id)]
        assert "worker_fenced" in kinds and "snoozed" not in kinds

        scene.release_new.set()
        run = wait_for(durable, scene.run_id, timeout=WAIT)
    assert (run.status, run.output, run.attempt) == ("completed", "new worker", 1)
    steps = durable.list_steps(scene.run_id)
    assert [(s.status, s.output, s.attempt) for s in steps] == [("completed", "new worker", 1)]
    assert scene.calls == 2


# -- KeyContended after exactly MAX_HANDS hand changes -------------------------------------------

# keys.MAX_HANDS as documented ("the key changed hands three times"); written out, so that a
# changed constant fails here rather than moving the test along with it.
HANDS = 3


class VanishingKey:
    """Plays other transactions handing a key around: the first ``times`` times a transaction
    locks the key row, the row is deleted (and committed) just before, and put back (committed)
    just after, so the lock finds nothing and the next claim finds the key held again.

    On PostgreSQL the other transaction is another connection; SQLite serialises writers (the
    start holds the write lock), so there its statements run on the start's own connection."""

    def __init__(self, durable: Any, monkeypatch: pytest.MonkeyPatch, times: int) -> None:
        self.durable, self.times = durable, times
        self.locks = 0  # lock_key_txn calls seen
        self.vanished = 0
        self._real = key_rows.lock_key_txn
        monkeypatch.setattr(key_rows, "lock_key_txn", self.lock_key_txn)

    def lock_key_txn(self, db: Any, conn: Any, workflow: str, key: str) -> Any:
        self.locks += 1
        if self.vanished >= self.times:
            return self._real(db, conn, workflow, key)
        self.vanished += 1
        where = (keys.c.workflow == workflow, keys.c.key == key)
        with self._other(conn) as other:
            row = other.execute(select(keys).where(*where)).mappings().one()
            other.execute(delete(keys).where(*where))
        found = self._real(db, conn, workflow, key)
        with self._other(conn) as other:
            other.execute(insert(keys).values(**row))
        return found

    @contextmanager
    def _other(self, conn: Any) -> Iterator[Any]:
        if self.durable.db.is_postgres:
            with self.durable.db.engine.begin() as other:
                yield other
        else:
            yield conn


def _define(durable: Any, **options: Any) -> Any:
    wf = durable.workflow("contended", **options)

    @wf.step
    def only(n=0):
        return n

    return wf


def _set_status(durable: Any, run_id: str, status: str) -> None:
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(status=status))


@pytest.mark.parametrize("vanishings", [HANDS - 1, HANDS])
def test_a_start_is_contended_after_max_hands_hand_changes_and_not_before(durable, monkeypatch, vanishings):
    wf = _define(durable)
    holder = durable.start(wf, {"n": 1}, key="k")
    vanishing = VanishingKey(durable, monkeypatch, vanishings)
    if vanishings < HANDS:
        with pytest.raises(KeyTaken) as taken:  # the key settled: the holder answers
            durable.start(wf, {"n": 2}, key="k", on_duplicate="error")
        assert taken.value.holder_id == holder
    else:
        with pytest.raises(KeyContended):
            durable.start(wf, {"n": 2}, key="k", on_duplicate="error")
    assert vanishing.vanished == vanishings
    assert vanishing.locks == vanishings + (vanishings < HANDS)
    assert [r.id for r in durable.list_runs()] == [holder]  # nothing written either way
    assert [(k.key, k.holder_id) for k in durable.list_keys()] == [("k", holder)]


@pytest.mark.parametrize("vanishings", [HANDS - 1, HANDS])
def test_a_start_taking_a_freed_key_is_contended_only_after_max_hands(durable, monkeypatch, vanishings):
    wf = _define(durable)  # reuse="after_close": a finished holder frees its key
    holder = durable.start(wf, {"n": 1}, key="k")
    _set_status(durable, holder, "completed")
    VanishingKey(durable, monkeypatch, vanishings)
    if vanishings < HANDS:
        new = durable.start(wf, {"n": 2}, key="k", on_duplicate="error")
        assert new != holder
        assert [(k.key, k.holder_id) for k in durable.list_keys()] == [("k", new)]
    else:
        with pytest.raises(KeyContended):
            durable.start(wf, {"n": 2}, key="k", on_duplicate="error")
        assert [r.id for r in durable.list_runs()] == [holder]


@pytest.mark.parametrize("vanishings", [HANDS - 1, HANDS])
def test_a_retry_is_contended_after_max_hands_hand_changes_and_not_before(durable, monkeypatch, vanishings):
    wf = _define(durable)
    failed = durable.start(wf, {"n": 1}, key="k")
    _set_status(durable, failed, "failed")
    VanishingKey(durable, monkeypatch, vanishings)
    if vanishings < HANDS:
        assert durable.retry(failed) == failed
        assert durable.get_run(failed).status == "pending"
    else:
        with pytest.raises(KeyContended):
            durable.retry(failed)
        assert durable.get_run(failed).status == "failed"
    assert [(k.key, k.holder_id) for k in durable.list_keys()] == [("k", failed)]


# -- a debounced holder a worker has started -----------------------------------------------------


def test_a_start_against_a_started_debounced_holder_is_an_ordinary_duplicate(durable):
    wf = durable.workflow("debounced_started", debounce={"period": 60})

    @wf.step
    def only(n):
        return n

    holder = durable.start(wf, {"n": 1}, key="k")
    # As after a claim and a retry: started, then put back to be run again.
    with durable.db.begin() as conn:
        started = conn.execute(select(runs.c.created_at).where(runs.c.id == holder)).scalar_one()
        conn.execute(update(runs).where(runs.c.id == holder).values(started_at=started))
    before = durable.get_run(holder)
    assert durable.start(wf, {"n": 2}, key="k") == holder
    after = durable.get_run(holder)
    assert after.input == {"n": 1}  # not folded in: the started holder keeps its input
    entry = durable.activity(kinds=["key_duplicate"])[0]
    assert entry.details["outcome"] == "use_existing"
    assert (after.status, after.started_at) == (before.status, before.started_at)
