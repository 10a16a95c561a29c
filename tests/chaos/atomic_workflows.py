"""The ledger workflows of the atomic scenario (``atomic.py``), defined on every chaos worker.

``ledger_atomic`` and ``ledger_plain`` run three steps: ``check`` and ``quote`` only sleep (time
for a cancel to land before the booking), and ``book`` inserts a row into ``atomic_ledger``
(workflow, run, account, amount, attempt, fence, process) and adds the amount to its account's
row of ``atomic_balances`` (the application's own tables, on durable's database; each workflow
has its own accounts, so both can run on one cluster). In ``ledger_atomic``
the step is ``atomic=True`` and writes on ``current_run().connection``; in ``ledger_plain`` it
writes on a connection of its own, in a transaction it commits itself, as a step without
``atomic`` would. After its writes ``book`` writes a ``wrote`` row to the chaos ledger (on the
ledger's own connection, so it stays whatever becomes of the step's transaction), then raises
(when its run is told to fail: on every attempt, or on the first) or holds its transaction open
``hold`` ms, so that a fault can land between its writes and its commit.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import uuid
from typing import Any

import psycopg
from sqlalchemy import Connection

from durable_celery import Durable, current_run
from tests.chaos.workflows import RETRY, Ledger

ATOMIC, PLAIN = "ledger_atomic", "ledger_plain"
BOOK = 2  # the index of the booking step
ACCOUNTS = 6  # balance rows: a few, so that bookings also wait for each other's row locks

TABLES_DDL = f"""
CREATE TABLE atomic_ledger (
    id bigserial PRIMARY KEY,
    workflow text NOT NULL,
    run_id text NOT NULL,
    account int NOT NULL,
    amount int NOT NULL,
    attempt int NOT NULL,
    fence int NOT NULL,
    pid int NOT NULL,
    at double precision NOT NULL
);
CREATE INDEX atomic_ledger_run ON atomic_ledger (run_id);
CREATE TABLE atomic_balances (
    workflow text NOT NULL, account int NOT NULL, total bigint NOT NULL, PRIMARY KEY (workflow, account)
);
INSERT INTO atomic_balances SELECT w, a, 0
    FROM unnest(ARRAY['{ATOMIC}', '{PLAIN}']) w, generate_series(0, {ACCOUNTS - 1}) a;
"""
_INSERT = (
    "INSERT INTO atomic_ledger (workflow, run_id, account, amount, attempt, fence, pid, at) VALUES "
    "(%(workflow)s, %(run_id)s, %(account)s, %(amount)s, %(attempt)s, %(fence)s, %(pid)s, %(at)s)"
)
_ADD = (
    "UPDATE atomic_balances SET total = total + %(amount)s "
    "WHERE workflow = %(workflow)s AND account = %(account)s"
)


class Declined(Exception):
    """What ``book`` raises after its writes when its run is told to fail."""


class OwnConnection:
    """A non-atomic step's writes: a connection per process and thread, and a transaction of
    its own committed before the step goes on (so a step that runs again writes again)."""

    def __init__(self, url: str) -> None:
        """No connection yet: each process and thread makes its own."""
        self.url = url
        self._local = threading.local()

    def book(self, values: dict[str, Any]) -> None:
        """The ledger row and the balance update, committed on this process's connection."""
        held = getattr(self._local, "held", None)
        if held is None or held[0] != os.getpid():  # a forked pool process makes its own
            held = (os.getpid(), psycopg.connect(self.url, connect_timeout=3))
            self._local.held = held
        try:
            with held[1].transaction():
                held[1].execute(_INSERT, values)
                held[1].execute(_ADD, values)
        except BaseException:  # an outage, or stopped mid-write: a fresh connection next time
            self._local.held = None
            with contextlib.suppress(Exception):
                held[1].close()
            raise


def _book_in(conn: Connection, values: dict[str, Any]) -> None:
    """The atomic step's writes on durable's connection (the same statements as
    ``OwnConnection``, with psycopg's placeholders)."""
    conn.exec_driver_sql(_INSERT, values)
    conn.exec_driver_sql(_ADD, values)


def _sleeper(index: int) -> Any:
    """The body of step ``index`` before the booking: it sleeps ``ms[index]`` milliseconds."""

    def body(
        tag: str, account: int, amount: int, ms: list[int], hold: int, fail: str, cancel_in: float | None
    ) -> str:
        """Sleep, and return the tag."""
        time.sleep(ms[index] / 1000)
        return tag

    body.__name__ = ("check", "quote")[index]
    return body


def _booker(ledger: Ledger | None, own: OwnConnection | None) -> Any:
    """The body of ``book``: on durable's connection (``own`` None: atomic) or on ``own``."""

    def book(
        tag: str, account: int, amount: int, ms: list[int], hold: int, fail: str, cancel_in: float | None
    ) -> dict[str, int]:
        """Book the amount, note it in the chaos ledger, then raise or hold the transaction open."""
        run = current_run()
        if ledger is not None:
            ledger.write("begin", BOOK)
        values = {
            "workflow": run.workflow,
            "run_id": run.id,
            "account": account,
            "amount": amount,
            "attempt": run.attempt,
            "fence": int(getattr(getattr(run, "_active", None), "fence", -1)),
            "pid": os.getpid(),
            "at": time.time(),
        }
        if own is None:
            _book_in(run.connection, values)
        else:
            own.book(values)
        if ledger is not None:
            ledger.write("wrote", BOOK)
        if fail == "always" or (fail == "first" and run.attempt == 1):
            raise Declined(f"{tag} declined on attempt {run.attempt}")
        time.sleep(hold / 1000)  # the step's transaction stays open meanwhile
        if ledger is not None:
            ledger.write("end", BOOK)
        return {"booked": amount}

    return book


def define_ledger(durable: Durable, ledger: Ledger | None = None) -> None:
    """Define ``ledger_atomic`` and ``ledger_plain`` on ``durable`` (a producer passes no
    ledger: it runs no step)."""
    own = OwnConnection(ledger.url) if ledger is not None else None
    for name, atomic in ((ATOMIC, True), (PLAIN, False)):
        wf = durable.workflow(name)
        for index, step in enumerate(("check", "quote")):
            wf.step(_sleeper(index), name=step, retry=RETRY)
        wf.step(_booker(ledger, None if atomic else own), name="book", retry=RETRY, atomic=atomic)


def new_ledger_input(rng: random.Random, cancel_share: float) -> dict[str, Any]:
    """A run's input: account and amount, the two sleeps, how long ``book`` holds its
    transaction (a quarter of them long enough for a targeted fault, all well under the
    ``stale_lock_timeout`` that ends an idle transaction), whether it fails (6% on every attempt,
    so the run fails after ``RETRY`` attempts; 15% on the first), and how many seconds after its
    start it is cancelled (None: never)."""
    long = rng.random() < 0.25
    roll = rng.random()
    return {
        "tag": uuid.uuid4().hex,
        "account": rng.randrange(ACCOUNTS),
        "amount": rng.randint(1, 1000),
        "ms": [rng.randint(50, 150), rng.randint(50, 150)],
        "hold": rng.randint(1500, 2200) if long else rng.randint(200, 500),
        "fail": "always" if roll < 0.06 else "first" if roll < 0.21 else "never",
        "cancel_in": round(rng.uniform(0.1, 2.5), 2) if rng.random() < cancel_share else None,
    }
