"""An atomic step moves money: its writes commit with durable's record of the step, or not at all.

The ledger's tables (``ledger_accounts``, ``ledger_transfers``) live in durable's own
PostgreSQL database, and the step ``move`` writes them on ``current_run().connection``, the
connection of the step's transaction (SQLAlchemy Core). Its first attempt debits, credits and
records the transfer, then a fraud check it calls times out: the attempt fails and everything it
wrote is rolled back, so its retry finds the balances untouched and writes them once. No
check-then-write.

It needs PostgreSQL (atomic steps do: ``Capability.ATOMIC_STEPS``), named by
DURABLE_DATABASE_URL; it makes durable's tables and the ledger's there, and starts the ledger's
two accounts over each time. A real Celery worker runs in this process, on ``memory://``:

    DURABLE_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/ledger python -m examples.ledger
"""

from __future__ import annotations

import os
import sys

from celery import Celery
from sqlalchemy import (
    Column,
    Connection,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.engine import make_url

from durable_celery import Durable, current_run
from durable_celery.testing import wait_for, worker

# The application's tables, beside durable's: what each account holds, and each transfer once.
ledger = MetaData()
accounts = Table(
    "ledger_accounts",
    ledger,
    Column("name", String(20), primary_key=True),
    Column("balance", Integer, nullable=False),
)
transfers = Table(
    "ledger_transfers",
    ledger,
    Column("id", String(40), primary_key=True),
    Column("source", ForeignKey("ledger_accounts.name"), nullable=False),
    Column("target", ForeignKey("ledger_accounts.name"), nullable=False),
    Column("amount", Integer, nullable=False),
)


def database_url() -> str:
    """DURABLE_DATABASE_URL, which must name a PostgreSQL database; else exit saying so."""
    url = os.environ.get("DURABLE_DATABASE_URL", "")
    if not url.startswith("postgresql"):
        given = f" (it is {make_url(url).render_as_string(hide_password=True)})" if url else ""
        sys.exit(f"examples/ledger.py needs PostgreSQL: set DURABLE_DATABASE_URL=postgresql://...{given}")
    return url


URL = database_url()
app = Celery("ledger", broker="memory://")
durable = Durable(app, URL, poll_interval=0.1, backoff_base=0.1)
outages = [TimeoutError("the fraud check did not answer")]  # its first call fails

transfer = durable.workflow("transfer")


def fraud_check(amount: int) -> None:
    """Another team's service, outside the step's transaction: it may time out."""
    if outages:
        raise outages.pop()


def balances(conn: Connection) -> str:
    """The accounts' balances and the number of transfers, as ``conn`` sees them."""
    rows = conn.execute(select(accounts.c.name, accounts.c.balance).order_by(accounts.c.name))
    count = conn.execute(select(func.count()).select_from(transfers)).scalar()
    return ", ".join(f"{name} {balance}" for name, balance in rows) + f"; transfers: {count}"


@transfer.step(atomic=True, retry=3)
def move(transfer_id: str, source: str, target: str, amount: int) -> dict[str, int]:
    """Debit ``source``, credit ``target`` and record the transfer, in the step's transaction."""
    conn = current_run().connection  # durable commits it with its record of this step
    attempt = current_run().attempt
    print(f"  attempt {attempt} finds: {balances(conn)}")
    for name, change in ((source, -amount), (target, amount)):
        conn.execute(
            update(accounts).where(accounts.c.name == name).values(balance=accounts.c.balance + change)
        )
    conn.execute(insert(transfers).values(id=transfer_id, source=source, target=target, amount=amount))
    print(f"  attempt {attempt} wrote: {balances(conn)}")
    fraud_check(amount)  # after the writes: a failure here rolls them back
    found = conn.execute(
        select(accounts.c.name, accounts.c.balance).where(accounts.c.name.in_([source, target]))
    )
    return {name: balance for name, balance in found}


def start_over(conn: Connection) -> None:
    """The ledger's tables, made if missing, with alice's 100 and bob's 20 and no transfer."""
    ledger.create_all(conn)
    conn.execute(delete(transfers))
    conn.execute(delete(accounts))
    conn.execute(insert(accounts), [{"name": "alice", "balance": 100}, {"name": "bob", "balance": 20}])


def main() -> None:
    durable.migrate()
    engine = create_engine(make_url(URL).set(drivername="postgresql+psycopg"))
    with engine.begin() as conn:
        start_over(conn)
        print("before:", balances(conn))
    with worker(durable):
        move_30 = {"transfer_id": "T-1", "source": "alice", "target": "bob", "amount": 30}
        run = wait_for(durable, transfer.start(move_30))
    for step in durable.list_steps(run.id):
        error = f": {step.error['message']}" if step.error else ""
        print(f"recorded: {step.name} attempt {step.attempt} {step.status}{error}")
    output = ", ".join(f"{name} {balance}" for name, balance in sorted(run.output.items()))
    print(f"run: {run.status}, its output: {output}")  # the balances the step saw at its end
    with engine.connect() as conn:
        print("after:", balances(conn))
    engine.dispose()


if __name__ == "__main__":
    main()
