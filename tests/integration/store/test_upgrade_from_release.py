"""Upgrading from the first release: a database at the schema of durable-celery 0.1.0, holding the
rows that release wrote, migrates to head with its data kept and usable.

``release_0_1_0_rows.json`` holds every row durable-celery 0.1.0 wrote on PostgreSQL for the
workflows below: a keyed ``send_receipt`` run completed (``reuse="never"``: it keeps its key), an
``approve_order`` run parked on the event ``approved``, a keyed ``sync_account`` run started
while no worker ran (its message lost with the broker), and a ``nightly-sync`` schedule kept by
``DurableScheduler``. The rows are loaded as they are into a database migrated to
``RELEASE_0_1_0_HEAD``; every later revision must carry them over.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from alembic import command
from celery import Celery

from durable_celery import Durable, current_run
from durable_celery.store.migrate import alembic_config, revisions
from durable_celery.testing import wait_for, worker
from tests.conftest import PG_HOST

pytestmark = pytest.mark.timeout(180)

# The schema revision of the first release, 0.1.0: its last migration.
RELEASE_0_1_0_HEAD = "0005"
ROWS = Path(__file__).with_name("release_0_1_0_rows.json")
RECEIPT = "01a23c27-f3fd-778d-8a74-b84db8b75b18"
APPROVAL = "01a23c27-f404-7136-9960-1414c7660681"
SYNC = "01a23c27-f80d-7ef0-9c61-0b56e3e79ad2"


def define(durable: Durable) -> None:
    """The workflows of 0.1.0's rows, as that release defined them."""

    @durable.workflow(key="receipt:{order_id}", reuse="never")
    def send_receipt(order_id: str, email: str) -> dict[str, str]:
        return {"to": email, "order": order_id}

    sync = durable.workflow("sync_account")

    @sync.step(retry=2)
    def fetch(account: str, **_: Any) -> dict[str, Any]:
        current_run().context["rows"] = 2
        return {"account": account}

    @sync.step
    def store(account: str, **_: Any) -> dict[str, Any]:
        return {"stored": current_run().context["rows"], "account": account}

    approve = durable.workflow("approve_order")

    @approve.step
    def ask(order_id: str, **_: Any) -> dict[str, Any]:
        answer = current_run().wait_for_event("approved")
        return {"order": order_id, "approved_by": answer["by"]}


def load_release_rows(conn: sa.Connection) -> None:
    """Insert the 0.1.0 rows into the tables as the database has them now (reflected)."""
    tables = sa.MetaData()
    tables.reflect(conn)
    for name, rows in json.loads(ROWS.read_text()).items():
        table = tables.tables[name]
        times = {c.name for c in table.columns if isinstance(c.type, sa.DateTime)}
        values = [
            {k: datetime.fromisoformat(v) if k in times and v is not None else v for k, v in row.items()}
            for row in rows
        ]
        conn.execute(table.insert(), values)


@pytest.fixture(params=["postgres", "sqlite"])
def release_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database at 0.1.0's schema holding 0.1.0's rows; a PostgreSQL one is dropped afterwards."""
    name = f"durable_up_{uuid.uuid4().hex[:10]}"
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/release.sqlite3"
    else:
        with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        url = f"{PG_HOST}/{name}"
    try:
        at_release = Durable(Celery("release", broker="memory://"), url, upkeep=False)
        command.upgrade(alembic_config(at_release.db), RELEASE_0_1_0_HEAD)
        with at_release.db.begin() as conn:
            load_release_rows(conn)
        at_release.db.dispose()
        yield url
    finally:
        if request.param == "postgres":
            with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_the_first_release_names_a_revision_of_this_code() -> None:
    assert RELEASE_0_1_0_HEAD in [revision for revision, _ in revisions()]


def test_a_database_of_the_first_release_upgrades_with_its_runs_keys_and_schedules(
    release_url: str, tmp_path: Path
) -> None:
    # No broker given: Durable's embedded one, in a folder of this test's own (home=). The
    # in-memory broker is the whole process's: a message another test left on its default queue
    # (where 0.1.0's rows send their runs) counted in the depth the relay's re-send budget reads.
    app = Celery("upgraded")
    app.conf.beat_scheduler = "durable_celery.beat:DurableScheduler"
    durable = Durable(app, release_url, home=str(tmp_path / "home"))
    define(durable)
    later = [revision for revision, _ in revisions()]
    later = later[later.index(RELEASE_0_1_0_HEAD) + 1 :]
    assert durable.pending_migrations() == later
    durable.migrate()
    assert durable.pending_migrations() == []

    # Read back as 0.1.0 wrote them.
    receipt = durable.get_run(RECEIPT)
    assert (receipt.status, receipt.key, receipt.holds_key) == ("completed", "receipt:A-1", True)
    assert receipt.output == {"to": "ada@example.com", "order": "A-1"}
    assert [(s.name, s.attempt, s.status) for s in durable.list_steps(RECEIPT)] == [
        ("send_receipt", 1, "completed")
    ]
    assert durable.get_run(APPROVAL).status == "waiting"
    assert durable.get_run(SYNC).status == "pending"
    held = {(k.workflow, k.key): k.holder_id for k in durable.list_keys()}
    assert held == {
        ("send_receipt", "receipt:A-1"): RECEIPT,
        ("approve_order", "approve:A-2"): APPROVAL,
        ("sync_account", "acct-7"): SYNC,
    }
    nightly = durable.get_schedule("nightly-sync")
    assert (nightly.workflow, nightly.key, nightly.schedule, nightly.input, nightly.enabled) == (
        "sync_account",
        "nightly",
        "0 6 * * *",
        {"account": "acct-9"},
        True,
    )

    # The keys still decide: a start with a held key gets its holder.
    assert durable.start("send_receipt", {"order_id": "A-1", "email": "ada@example.com"}) == RECEIPT
    assert durable.start("sync_account", {"account": "acct-7"}, key="acct-7") == SYNC
    assert durable.disable_schedule("nightly-sync").enabled is False
    assert durable.enable_schedule("nightly-sync").enabled is True

    # And the runs go on: the relay re-sends the pending run's lost message, the event resumes
    # the parked run, and the schedule fires.
    assert durable.send_event(APPROVAL, "approved", {"by": "grace"}) is True
    with worker(durable):
        synced = wait_for(durable, SYNC, timeout=90)
        approved = wait_for(durable, APPROVAL, timeout=90)
        fired = wait_for(durable, durable.trigger_schedule("nightly-sync"), timeout=90)
    assert (synced.status, synced.output) == ("completed", {"stored": 2, "account": "acct-7"})
    assert (approved.status, approved.output) == ("completed", {"order": "A-2", "approved_by": "grace"})
    assert (fired.status, fired.key) == ("completed", "nightly")
    assert fired.output == {"stored": 2, "account": "acct-9"}
    durable.db.dispose()
