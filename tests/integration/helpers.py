"""Helpers the integration tests of several packages share: reading and writing a run's row
directly, a small workflow to decide keys on, the records a key decision leaves, and a queue's
messages on either broker (Redis or RabbitMQ), read through kombu as the relay reads them.

Rows are put in the state a case needs by writing them directly; the code under test reads
nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update

from durable_celery import current_run
from durable_celery.store.schema import activity, keys, runs
from durable_celery.worker.relay import broker_depths
from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parents[2]

# -- a run's row --------------------------------------------------------------------------------


def run_row(durable: Any, run_id: str) -> Any:
    """A run's stored row, every column, as a Row."""
    with durable.db.engine.connect() as conn:
        return conn.execute(select(runs).where(runs.c.id == run_id)).one()


def run_dict(durable: Any, run_id: str) -> dict[str, Any]:
    """A run's stored row, every column, as a dict."""
    with durable.db.engine.connect() as conn:
        return conn.execute(select(runs).where(runs.c.id == run_id)).one()._asdict()


def set_run(durable: Any, run_id: str, **values: Any) -> None:
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(**values))


def ago(durable: Any, seconds: float) -> Any:
    return durable.db.utcnow() - timedelta(seconds=seconds)


def set_waiting(durable: Any, run_id: str, name: str = "paid") -> None:
    """The run waits for the event ``name`` (started five seconds ago), not due."""
    set_run(durable, run_id, status="waiting", wait_name=name, due_at=None, published=False)
    set_run(durable, run_id, started_at=ago(durable, 5))


def count_rows(durable: Any, table: Any) -> int:
    with durable.db.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar()


def activity_log(durable: Any) -> list[tuple[Any, ...]]:
    """Every activity entry, oldest first: (kind, run id, details)."""
    with durable.db.engine.connect() as conn:
        found = conn.execute(
            select(activity.c.kind, activity.c.run_id, activity.c.details).order_by(activity.c.id)
        )
        return [tuple(entry) for entry in found]


# -- workflows ----------------------------------------------------------------------------------


def one_step(durable: Any, name: str) -> Any:
    wf = durable.workflow(name)
    wf.step(lambda: 1, name="only")
    return wf


def two_step_workflow(durable: Any, name: str = "decided", **options: Any) -> Any:
    wf = durable.workflow(name, **options)

    @wf.step
    def first(n=0):
        return n

    @wf.step
    def second(n=0):
        return n

    return wf


class Steps:
    """A two-step workflow whose steps note the run's row as they see it while they run."""

    def __init__(self, durable: Any, **options: Any) -> None:
        self.durable = durable
        self.rows: list[Any] = []
        self.fail_first = options.pop("fail_first", False)
        self.wf = durable.workflow("claimed", **options)

        @self.wf.step(retry=2)
        def first():
            self.rows.append(run_row(durable, current_run().id))
            if self.fail_first and len(self.rows) == 1:
                raise ValueError("first attempt fails")
            return "one"

        @self.wf.step
        def second():
            self.rows.append(run_row(durable, current_run().id))
            return "two"

    def run(self, run_id: str, step: int) -> str:
        return self.durable.run_message("claimed", step, run_id)


def start_runs(durable: Any, steps: Steps, n: int) -> list[str]:
    return [durable.start(steps.wf) for _ in range(n)]


# -- keys -----------------------------------------------------------------------------------------


def key_row(durable: Any, workflow: str, key: str) -> Any:
    with durable.db.engine.connect() as conn:
        return conn.execute(select(keys).where(keys.c.workflow == workflow, keys.c.key == key)).one_or_none()


def key_holders(durable: Any, workflow: str, key: str = "k") -> tuple[str, str | None]:
    row = key_row(durable, workflow, key)
    return row.holder_id, row.waiting_id


def only_entry(durable: Any, kind: str) -> Any:
    entries = durable.activity(kinds=[kind])
    assert len(entries) == 1, entries
    return entries[0]


def started_run(durable: Any, wf: Any, seen: Any, data: dict[str, Any], key: str = "k") -> str:
    """Start a keyed run, check what the start announced and sent, and forget it."""
    run_id = durable.start(wf, data, key=key)
    assert seen.signals == [("run_started", {"run_id": run_id, "workflow": wf.name, "key": key})]
    assert seen.published == [(wf.name, 0, run_id, 1, key)]
    seen.clear()
    return run_id


# -- a queue on the broker (Redis or RabbitMQ) ----------------------------------------------------


def queue_depth(app: Any, queue: str) -> int:
    """Messages the broker holds in ``queue`` (0 when it has no such queue), read as the relay's
    re-send budget reads it."""
    depths = broker_depths(app, [queue])
    assert depths is not None, f"the broker of {app.main} did not answer"
    return depths[queue]


def drop_messages(app: Any, queue: str) -> None:
    """What a broker that lost its messages looks like: ``queue`` emptied (if it exists)."""
    with app.connection_for_write() as conn, conn.channel() as channel, suppress(*conn.channel_errors):
        channel.queue_purge(queue)  # RabbitMQ refuses it for a queue it lacks: nothing to lose


def delete_queue(app: Any, queue: str) -> None:
    """Remove ``queue`` and what it holds from the broker (a test's clean-up)."""
    drop_messages(app, queue)  # kombu's Redis deletes only a queue this process declared
    with app.connection_for_write() as conn, conn.channel() as channel, suppress(*conn.channel_errors):
        channel.queue_delete(queue)


def take_messages(app: Any, queue: str) -> list[Any]:
    """Every message ``queue`` holds, oldest first, taken off it (kombu messages: ``headers``,
    ``delivery_info``, ``properties``)."""
    taken = []
    with app.connection_for_write() as conn, conn.channel() as channel:
        try:
            while (raw := channel.basic_get(queue, no_ack=True)) is not None:
                taken.append(channel.message_to_python(raw))
        except conn.channel_errors:  # RabbitMQ has no such queue: it holds nothing
            pass
    return taken


def message_run_id(message: Any) -> str:
    """The run id a step message carries (its ``kwargsrepr`` header names it first)."""
    return str(message.headers["kwargsrepr"].split(",")[0].removeprefix("{run_id: "))


def cli_app(durable: Any, folder: Any, name: str, define: str, command: tuple[str, ...] = ()) -> Any:
    """A Celery app module ``name`` in ``folder`` on ``durable``'s database and queue whose
    ``define(durable)`` (from the source ``define``) defines its workflows, and a function that
    runs ``celery -A name durable *command *args`` on it: its stdout, or stdout and stderr when
    the expected exit ``code`` is not 0."""
    (folder / f"{name}.py").write_text(
        define
        + textwrap.dedent(f"""
        from celery import Celery
        from durable_celery import Durable
        app = Celery({name!r}, broker={REDIS_URL!r})
        app.conf.task_default_queue = {durable.app.conf.task_default_queue!r}
        durable = Durable(app, {durable.db.url!r}, upkeep=False)
        define(durable)
    """)
    )
    env = {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{ROOT}"}

    def run(*args: str, code: int = 0) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "celery", "-A", name, "durable", *command, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == code, out.stdout + out.stderr
        return out.stdout if code == 0 else out.stdout + out.stderr

    return run
