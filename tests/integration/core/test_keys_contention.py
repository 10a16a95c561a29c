"""A key that keeps changing hands under a start or a retry: ``KeyContended`` after exactly
``MAX_HANDS`` hand changes, and not before. Another transaction deleting and re-inserting the key
row at exactly the moment between the start's statements is played by wrapping
``key_rows.lock_key_txn``. On both backends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import delete, insert, select, update

from durable_celery import KeyContended, KeyTaken
from durable_celery.store import key_rows
from durable_celery.store.schema import keys, runs

pytestmark = pytest.mark.timeout(60)


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
    """Guards issue 16: ``KeyContended`` after exactly ``MAX_HANDS`` hand changes, and not
    before (a start)."""
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
    """Guards issue 16: ``KeyContended`` after exactly ``MAX_HANDS`` hand changes, and not before (a start
    taking a key its finished holder freed)."""
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
    """Guards issue 16: ``KeyContended`` after exactly ``MAX_HANDS`` hand changes, and not
    before (a retry)."""
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
