"""Writing a step's outcome: the run's next state and the step's row in one statement or
transaction (or in an atomic step's own transaction), kept through a database outage, and what
its commit sets off (a waiting run of the key, a parent woken, the next step claimed inline)."""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from ..errors import DatabaseUnavailable
from ..store import key_rows, queries
from . import continuation
from .control import after_commit
from .keys import settle_waiting_txn, wake_parent_txn
from .outcomes import ENDED

if TYPE_CHECKING:
    from ..definition import Workflow
    from ..store.db import Database
    from .atomic import StepTransaction
    from .runtime import Runtime

log = logging.getLogger("durable_celery")


class StepWrites:
    """The engine's writes of step outcomes (mixed into ``engine.Engine``)."""

    rt: Runtime
    db: Database

    def drain_over(self) -> bool:
        """Is the grace period of a graceful shutdown over (the engine's)?"""
        raise NotImplementedError

    def _write(
        self,
        workflow: Workflow,
        row: Any,
        status: str,
        run_values: dict[str, Any],
        step_row: dict[str, Any],
        go_on: queries.GoOn | None = None,
        tx: StepTransaction | None = None,
    ) -> tuple[bool, Any]:
        """Write the step's outcome and the run's next state: (recorded, fence if not); with
        ``go_on``, claim the next step too (continuation.py); with ``tx``, in an atomic step's
        transaction (an outage there is the transaction's: nothing of it is kept).

        A database outage does not cost the step: the write is tried again until the database
        is back (no sweep hands the run away before it has seen the database for
        ``stale_lock_timeout`` after the outage), or until a shutdown's grace period is over,
        and a write whose commit went through unanswered is known by its step row.
        """
        if tx is not None:
            return self._write_once(workflow, row, status, run_values, step_row, go_on, tx)
        waited, pause = 0.0, 0.2
        while True:
            try:
                recorded, fence_now = self._write_once(workflow, row, status, run_values, step_row, go_on)
            except DatabaseUnavailable as exc:
                if self.drain_over():
                    raise
                if not waited:
                    log.warning("durable: run %s: %s; its outcome is kept until then", row.id, exc)
                time.sleep(pause)
                # Never slower than the heartbeats it stands in for: the write must land before
                # a sweep that waited out its own window after the outage takes the run.
                waited, pause = waited + pause, min(pause * 2, self.rt.settings.heartbeat_interval)
                continue
            if not recorded and waited and self._wrote_before(row, step_row):
                log.warning("durable: run %s: the outcome was recorded before the outage ended", row.id)
                if go_on is not None:
                    with self.db.engine.connect() as conn:
                        continuation.claimed(queries.run_held_by(conn, row.id, go_on.node), go_on)
                return True, None
            return recorded, fence_now

    def _wrote_before(self, row: Any, step_row: dict[str, Any]) -> bool:
        """Did an earlier try of this write commit (its answer lost to the outage)?"""
        with self.db.engine.connect() as conn:
            return queries.step_recorded(
                conn,
                row.id,
                step_row["step_index"],
                step_row.get("phase", "step"),
                row.attempt,
                step_row["worker"],
            )

    def _write_once(
        self,
        workflow: Workflow,
        row: Any,
        status: str,
        run_values: dict[str, Any],
        step_row: dict[str, Any],
        go_on: queries.GoOn | None = None,
        tx: StepTransaction | None = None,
    ) -> tuple[bool, Any]:
        finishing = status in ENDED
        settled = None
        if tx is not None:
            written, fence_now, settled = self._write_txn(
                tx.conn, workflow, row, status, run_values, step_row, go_on
            )
            tx.recorded = recorded = written is not None
            tx.on_commit(partial(self._written, settled, written, go_on))
            return recorded, fence_now
        if self.db.is_postgres and not (finishing and (row.key or row.parent_id)):
            with self.db.single() as conn:  # one statement, committed on its own
                written = queries.record_step(
                    self.db, conn, row.id, row.fence, row.locked_by, run_values, step_row, go_on
                )
                recorded = written is not None
                fence_now = None if recorded else queries.run_hold(conn, row.id)
        else:
            with self.db.begin() as conn:
                written, fence_now, settled = self._write_txn(
                    conn, workflow, row, status, run_values, step_row, go_on
                )
                recorded = written is not None
        self._written(settled, written, go_on)
        return recorded, fence_now

    def _write_txn(
        self, conn: Any, workflow: Workflow, row: Any, status: str, run_values: dict[str, Any],
        step_row: dict[str, Any], go_on: queries.GoOn | None,
    ) -> tuple[Any, Any, Any]:  # fmt: skip
        """The record in ``conn``'s transaction: (the written row or None, the fence if not,
        what a finished run settled: its key's waiting run, its parent)."""
        settled, finishing = None, status in ENDED
        # The key row is locked before the run row, the order every transaction keeps.
        key_row = key_rows.key_of_holder_txn(conn, row.id) if finishing and row.key else None
        # One statement on PostgreSQL (an atomic step's transaction is in store/direct.py's reach).
        record = queries.record_step if self.db.is_postgres else queries.record_step_txn
        written = record(self.db, conn, row.id, row.fence, row.locked_by, run_values, step_row, go_on)
        fence_now = None if written is not None else queries.run_hold(conn, row.id)
        if written is not None and key_row is not None:
            settled = settle_waiting_txn(self.rt, conn, key_row, status, workflow)
        if written is not None and finishing and row.parent_id is not None:
            settled = wake_parent_txn(self.rt, conn, row.id, settled)
        return written, fence_now, settled

    def _written(self, settled: Any, written: Any, go_on: queries.GoOn | None) -> None:
        """After the record's commit: what it settled, and the next step it claimed."""
        if settled is not None:
            after_commit(self.rt, settled)
        if go_on is not None:
            continuation.claimed(written, go_on)
