"""What a three-step run costs PostgreSQL: statements, rows written, bytes stored, dead tuples; and
what a large payload costs it. The figures in the docs are written by this script.

    python -m bench.run_cost [--runs 500] [--input-runs 20] [--concurrency 1]
    python -m bench.run_cost --write-docs     # the same, then rewrites the docs' figure blocks

A scratch database (``bench_ops_cost_*``) with autovacuum off on durable's tables, so dead row
versions stay countable. ``--runs`` runs of a workflow of three no-op steps are started with
``durable.start()``, then worked by an in-process Celery worker (``--concurrency`` threads, 1)
on Redis, with upkeep off and the default settings (inline continuation on: one message per run,
the steps go on in the same task): this is the cost of a run itself, not of the periodic passes.
Every run is started before the worker takes any, they are worked one at a time, and a snapshot
is held open meanwhile, so no dead row version is pruned from its page (nor its index entries
deleted): bytes on disk are every version a run writes, and come out the same from one
measurement to the next (with pruning, what it reclaims depends on timing). Then the
engine is disposed (closing its backends flushes their statistics) and the figures are deltas of
``pg_stat_user_tables`` (rows inserted, updated, HOT-updated, deleted, dead) and of
``pg_total_relation_size``, plus ``pg_column_size`` of the live rows, per run. Statements are
counted with SQLAlchemy's ``before_cursor_execute`` on ``durable.db.engine`` (the worker's schema
check when it starts is left out); then those of as many runs started with a key of their own.
The database is dropped; the Redis queue used is one of its own and is left empty.

Then what a payload carried through a run costs ("Pass ids, not payloads" in
docs/production.md): three-step runs whose first step puts the input's ``doc`` in
``current_run().context``, ``--runs`` of them with a document id as ``doc`` and
``--input-runs`` with a 100 KB document; and ``--runs`` with the id whose steps each log one
WARNING line (what log capture stores per run); bytes on disk (``pg_total_relation_size``, dead
versions, TOAST and indexes included) and bytes of live rows per run.

Then what inputs cost: ``--input-runs`` runs of three steps with a 100 KB input (random, so TOAST
cannot compress it away), and as many keyed runs of that size that each get 10 duplicate starts
with a 100 KB input of their own (answered ``use_existing``, so each is dropped and recorded in
``durable_activity``), started before the worker takes them. Their figures are
``pg_total_relation_size`` deltas (heap, TOAST and indexes) per run.

``--write-docs`` rewrites the blocks between ``<!-- bench.run_cost: NAME -->`` and
``<!-- /bench.run_cost: DIGEST -->`` in ``DOCS`` (``cost``, ``payloads``, ``inputs``), each with
the date and the command that made it; the digest is of the block's text, so
``tests/integration/test_docs_figures.py`` tells a block edited by hand from one written here,
and checks the figures against a small measurement of its own.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import textwrap
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import click
from celery import Celery
from sqlalchemy import create_engine, event, text

from bench.common import say
from bench.scratch import SERVER, TABLES, Timer, scratch_database
from durable_celery import Durable, current_run
from durable_celery.testing import worker

REFERENCE = {"statements": 23, "bytes": 3000, "dead": 15}
INPUT_BYTES = 100_000
DUPLICATES = 10
SIZED = ("durable_runs", "durable_steps", "durable_activity")
FIELDS = ("n_tup_ins", "n_tup_upd", "n_tup_hot_upd", "n_tup_del", "n_dead_tup", "total")

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "docs" / "production.md", ROOT / "bench" / "README.md")
COMMAND = "python -m bench.run_cost --write-docs"
# Figures that do not depend on timing or page layout: the docs must show what is measured.
EXACT = ("cost.statements", "cost.statements_keyed", "cost.rows_written", "cost.dead")
TOLERANCE = 0.25  # for byte figures, of the figure (or of its row's total)

# The rows and columns of the blocks' tables, by key. Labels are fixed: ``read_figures`` finds
# the figures in the docs by them.
PER_RUN = "per run"
COST_ROWS = {
    "statements": "SQL statements",
    "statements_keyed": "SQL statements, started with a key of its own",
    "rows_written": "rows written (inserted + updated + deleted)",
    "dead": "dead row versions",
    "disk": "bytes on disk (indexes and every dead version included)",
    "live": "bytes of live rows",
}
PAYLOAD_ROWS = {
    "id": 'a document id (`"s3://bucket/<uuid>"`), kept in the context',
    "document": "the 100 KB document itself, as input and in the context",
    "logs": "the document id, and each step logs one WARNING line (log capture keeps it)",
}
PAYLOAD_COLUMNS = {
    "disk": "bytes on disk per run (every dead version included)",
    "live": "bytes of live rows per run",
}
INPUT_ROWS = {
    "plain": "three steps, 100 KB input",
    "duplicates": f"... and {DUPLICATES} duplicate starts of 100 KB",
}
INPUT_COLUMNS = {**{t: t for t in SIZED}, "total": "total"}
BLOCKS = ("cost", "payloads", "inputs")

STATS = """
SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, n_dead_tup,
       pg_total_relation_size(relid) AS total
FROM pg_stat_user_tables WHERE relname = ANY(:tables)
"""


@dataclass
class Figures:
    """What one measurement found, per run."""

    runs: int
    input_runs: int
    concurrency: int = 1
    postgres: str = ""
    statements: dict[str, float] = field(default_factory=dict)  # by verb
    keyed: dict[str, float] = field(default_factory=dict)  # by verb, runs started with a key
    tables: dict[str, dict[str, float]] = field(default_factory=dict)  # by table, by FIELDS
    live: dict[str, float] = field(default_factory=dict)  # live row bytes: runs, steps
    payloads: dict[str, dict[str, float]] = field(default_factory=dict)  # PAYLOAD_ROWS x COLUMNS
    inputs: dict[str, dict[str, float]] = field(default_factory=dict)  # INPUT_ROWS x SIZED

    def total(self, name: str) -> float:
        """One of FIELDS summed over the tables."""
        return sum(t[name] for t in self.tables.values())

    def flat(self) -> dict[str, float]:
        """The figures the docs' blocks show, by ``block.key`` (as ``read_figures`` reads them)."""
        cost = {
            "statements": sum(self.statements.values()),
            "statements_keyed": sum(self.keyed.values()),
            "rows_written": self.total("n_tup_ins") + self.total("n_tup_upd") + self.total("n_tup_del"),
            "dead": self.total("n_dead_tup"),
            "disk": self.total("total"),
            "live": sum(self.live.values()),
        }
        figures = {f"cost.{k}": v for k, v in cost.items()}
        for case, values in self.payloads.items():
            figures.update({f"payloads.{case}.{k}": v for k, v in values.items()})
        for case, sizes in self.inputs.items():
            figures.update({f"inputs.{case}.{t}": v for t, v in sizes.items()})
            figures[f"inputs.{case}.total"] = sum(sizes.values())
        return figures


def snapshot(engine: Any) -> dict[str, dict[str, int]]:
    """Per table: the pg_stat_user_tables counters and the total size, read afresh."""
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        rows = conn.execute(text(STATS), {"tables": list(TABLES)}).mappings().all()
    return {r["relname"]: {k: int(v) for k, v in r.items() if k != "relname"} for r in rows}


def live_bytes(engine: Any) -> dict[str, int]:
    """Bytes of the live rows of runs and steps, as stored (``pg_column_size`` of each row)."""
    with engine.connect() as conn:
        return {
            t: int(
                conn.execute(text(f"SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM {t} t")).scalar() or 0
            )
            for t in ("durable_runs", "durable_steps")
        }


def total_sizes(engine: Any, tables: tuple[str, ...] = SIZED) -> dict[str, int]:
    """``pg_total_relation_size`` (heap, TOAST, indexes) of each of ``tables``."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT relname, pg_total_relation_size(relid) FROM pg_stat_user_tables"
                " WHERE relname = ANY(:t)"
            ),
            {"t": list(tables)},
        ).all()
    return {name: int(size) for name, size in rows}


def keep_doc(doc: str) -> None:
    """The first step of ``bench3_context``: the document (or its id) goes in the context."""
    current_run().context["doc"] = doc


def log_a_warning(doc: str) -> None:
    """A step of ``bench3_logs``: one WARNING line, which log capture saves on the step's row."""
    logging.getLogger("bench.shop").warning(
        "charged the card for %s (attempt %d)", doc, current_run().attempt
    )


def keep_doc_and_log(doc: str) -> None:
    """The first step of ``bench3_logs``: as ``bench3_context``'s, and one WARNING line."""
    keep_doc(doc)
    log_a_warning(doc)


def build(url: str, broker: str, queue: str) -> Durable:
    app = Celery("bench_cost", broker=broker, set_as_current=True)
    app.conf.update(
        task_default_queue=queue, broker_connection_retry_on_startup=True, worker_hijack_root_logger=False
    )
    durable = Durable(app, url, upkeep=False)
    wf = durable.workflow("bench3")
    for name in ("first", "second", "third"):
        wf.step(lambda: None, name=name)
    sized = durable.workflow("bench3_input")
    for name in ("first", "second", "third"):
        sized.step(lambda blob: None, name=name)
    carried = durable.workflow("bench3_context")
    carried.step(keep_doc, name="first")
    for name in ("second", "third"):
        carried.step(lambda doc: None, name=name)
    logged = durable.workflow("bench3_logs")
    logged.step(keep_doc_and_log, name="first")
    for name in ("second", "third"):
        logged.step(log_a_warning, name=name)
    return durable


def random_text(length: int) -> str:
    """``length`` characters of base64 of random bytes: JSON that TOAST cannot compress."""
    return base64.b64encode(os.urandom(length * 3 // 4 + 3)).decode()[:length]


def payload() -> dict[str, str]:
    """An input of ``INPUT_BYTES`` of JSON that does not compress (so TOAST keeps all of it)."""
    return {"blob": random_text(INPUT_BYTES - len('{"blob": ""}'))}


def input_costs(
    durable: Durable, observer: Any, timer: Timer, queue: str, concurrency: int, runs: int
) -> dict[str, dict[str, float]]:
    """Bytes per run of a 100 KB input on three steps, then of keyed ones with 10 duplicates."""
    figures = {}
    for case, duplicates in (("plain", 0), ("duplicates", DUPLICATES)):
        before = total_sizes(observer)
        say(f"{timer} starting {runs} runs: {INPUT_ROWS[case]}")
        ids = []
        for i in range(runs):
            key = f"sized-{i}" if duplicates else None
            ids.append(durable.start("bench3_input", payload(), key=key))
            for _ in range(duplicates):
                durable.start("bench3_input", payload(), key=key, on_duplicate="use_existing")
        with worker(durable, concurrency=concurrency, queues=[queue]):
            wait_all(observer, ids, timer)
        after = total_sizes(observer)
        figures[case] = {t: (after[t] - before[t]) / runs for t in SIZED}
    return figures


def payload_costs(
    durable: Durable, observer: Any, timer: Timer, queue: str, concurrency: int, runs: int, input_runs: int
) -> dict[str, dict[str, float]]:
    """Bytes on disk and of live rows per run: a document id kept in the context, then a 100 KB
    document as input and in the context."""
    documents: dict[str, tuple[str, int, Callable[[], str]]] = {
        "id": ("bench3_context", runs, lambda: f"s3://bucket/{uuid.uuid4()}"),
        "document": ("bench3_context", input_runs, lambda: random_text(INPUT_BYTES - len('{"doc": ""}'))),
        "logs": ("bench3_logs", runs, lambda: f"s3://bucket/{uuid.uuid4()}"),
    }
    figures = {}
    for case, (workflow, n, document) in documents.items():
        before, before_live = total_sizes(observer, TABLES), live_bytes(observer)
        say(f"{timer} starting {n} runs: {PAYLOAD_ROWS[case]}")
        with nothing_pruned(observer):
            ids = [durable.start(workflow, {"doc": document()}) for _ in range(n)]
            with worker(durable, concurrency=concurrency, queues=[queue]):
                wait_all(observer, ids, timer)
        after, after_live = total_sizes(observer, TABLES), live_bytes(observer)
        figures[case] = {
            "disk": (sum(after.values()) - sum(before.values())) / n,
            "live": (sum(after_live.values()) - sum(before_live.values())) / n,
        }
    return figures


def run_costs(
    durable: Durable, observer: Any, timer: Timer, queue: str, concurrency: int, runs: int, figures: Figures
) -> None:
    """Statements, table counters and live bytes per run of ``runs`` three-step no-op runs."""
    with worker(durable, concurrency=concurrency, queues=[queue]):
        warm = [durable.start("bench3") for _ in range(5)]
        wait_all(observer, warm, timer)
    durable.db.dispose()
    time.sleep(1.2)
    before, before_live = snapshot(observer), live_bytes(observer)
    # Every run is started before the worker takes any: the pages a run's rows land on do not
    # then depend on how starts and steps interleave (nor on timing, with one worker thread).
    with counting(durable) as statements, nothing_pruned(observer):
        say(f"{timer} starting {runs} runs")
        ids = [durable.start("bench3") for _ in range(runs)]
        with worker(durable, concurrency=concurrency, queues=[queue]):
            wait_all(observer, ids, timer)
    durable.db.dispose()  # backends exit and flush their statistics
    time.sleep(1.5)
    after, after_live = snapshot(observer), live_bytes(observer)
    figures.statements = {verb: n / runs for verb, n in sorted(statements.items())}
    figures.tables = {
        t: {f: (after[t][f] - before[t][f]) / runs for f in FIELDS} for t in TABLES if t in after
    }
    figures.live = {t: (after_live[t] - before_live[t]) / runs for t in after_live}
    with counting(durable) as keyed:
        say(f"{timer} starting {runs} runs with keys")
        ids = [durable.start("bench3", key=f"cost-{i}") for i in range(runs)]
        with worker(durable, concurrency=concurrency, queues=[queue]):
            wait_all(observer, ids, timer)
    figures.keyed = {verb: n / runs for verb, n in sorted(keyed.items())}


@contextmanager
def nothing_pruned(engine: Any) -> Iterator[None]:
    """Hold a snapshot open while in the block: no row version that dies meanwhile can be
    pruned from its page (nor its index entries deleted), so every one stays on disk."""
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            conn.execute(text("SELECT 1"))  # the snapshot is taken here
            yield


@contextmanager
def counting(durable: Durable) -> Iterator[Counter[str]]:
    """Statements sent on ``durable.db.engine`` while in the block, by their first word."""
    statements: Counter[str] = Counter()
    lock = threading.Lock()

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "durable_alembic_version" in statement or "pg_catalog." in statement:
            return  # the worker's schema check when it starts: not a run's
        with lock:
            statements[statement.split(None, 1)[0].upper()] += 1

    event.listen(durable.db.engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", count)


def measure(runs: int, concurrency: int, broker_url: str, server: str, input_runs: int) -> Figures:
    """Every figure, on a scratch database of its own (dropped) and a Redis queue of its own."""
    timer = Timer()
    queue = f"bench-cost-{uuid.uuid4().hex[:8]}"
    figures = Figures(runs=runs, input_runs=input_runs, concurrency=concurrency)
    with scratch_database(server, "bench_ops_cost") as url:
        observer = create_engine(url, isolation_level="AUTOCOMMIT")
        with observer.connect() as conn:
            for table in TABLES:
                conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
            version = int(conn.execute(text("SELECT current_setting('server_version_num')")).scalar() or 0)
        figures.postgres = f"PostgreSQL {version // 10000}"
        durable = build(url, broker_url, queue)
        try:
            run_costs(durable, observer, timer, queue, concurrency, runs, figures)
            figures.payloads = payload_costs(durable, observer, timer, queue, concurrency, runs, input_runs)
            figures.inputs = input_costs(durable, observer, timer, queue, concurrency, input_runs)
        finally:
            durable.db.dispose()
            observer.dispose()
    return figures


@click.command()
@click.option(
    "--runs",
    "-n",
    default=500,
    show_default=True,
    type=click.IntRange(1),
    help="Runs measured: no-op runs, and runs carrying a document id.",
)
@click.option(
    "--concurrency",
    "-c",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Worker threads (with more, bytes on disk vary more from one measurement to the next).",
)
@click.option(
    "--broker-url", default="redis://127.0.0.1:6379/11", show_default=True, help="Redis (not flushed)."
)
@click.option("--server", default=SERVER, show_default=True, help="PostgreSQL server (database made there).")
@click.option(
    "--input-runs",
    default=20,
    show_default=True,
    type=click.IntRange(1),
    help="Runs measured per 100 KB case (document in the context; input; with 10 duplicate starts).",
)
@click.option(
    "--write-docs",
    is_flag=True,
    help="Then rewrite the figure blocks (<!-- bench.run_cost: NAME -->) of docs/production.md"
    " and bench/README.md with what was measured.",
)
def main(
    runs: int, concurrency: int, broker_url: str, server: str, input_runs: int, write_docs: bool
) -> None:
    """Per-run cost of a three-step run, of payloads and of large inputs (prints figures, not a
    test; --write-docs puts them in the docs)."""
    figures = measure(runs, concurrency, broker_url, server, input_runs)
    report(figures)
    report_payloads(figures)
    report_inputs(figures)
    if write_docs:
        blocks = render(figures, date.today())
        for path in DOCS:
            written = write_blocks(path, blocks)
            say(f"{path.relative_to(ROOT)}: rewrote {', '.join(written) or 'no block'}")


def wait_all(engine: Any, ids: list[str], timer: Timer, timeout: float = 300.0) -> None:
    """Poll (on an engine of its own, not counted) until every run completed."""
    deadline, shown = time.monotonic() + timeout, -1
    while True:
        with engine.connect() as conn:
            done = int(
                conn.execute(
                    text("SELECT count(*) FROM durable_runs WHERE id = ANY(:ids) AND status = 'completed'"),
                    {"ids": ids},
                ).scalar()
                or 0
            )
        if done * 10 // len(ids) != shown:
            shown = done * 10 // len(ids)
            say(f"{timer}   {done}/{len(ids)} runs completed")
        if done == len(ids):
            return
        if time.monotonic() > deadline:
            raise click.ClickException(f"only {done} of {len(ids)} runs completed in {timeout}s")
        time.sleep(0.1)


def report(figures: Figures) -> None:
    """Print the per-run figures against the reference."""
    runs = figures.runs
    say("")
    say(
        f"per three-step run ({runs} runs): statements by verb "
        + ", ".join(f"{k} {v:.2f}" for k, v in figures.statements.items())
    )
    say("... started with a key of its own: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.keyed.items()))
    say(f"{'table':18}  {'ins':>6}  {'upd':>6}  {'hot':>6}  {'del':>6}  {'dead':>6}  {'bytes':>8}")
    for table, values in figures.tables.items():
        cells = "  ".join(f"{values[f]:>6.2f}" for f in FIELDS[:-1])
        say(f"{table:18}  {cells}  {values['total']:>8.0f}")
    live = figures.live
    say(
        f"live row bytes per run (pg_column_size): runs {live['durable_runs']:.0f}, "
        f"steps {live['durable_steps']:.0f}, total {sum(live.values()):.0f}"
    )
    flat = figures.flat()
    say("")
    say(f"{'metric':34}  {'measured':>9}  {'reference':>9}  verdict")
    rows = [
        ("SQL statements per run", flat["cost.statements"], REFERENCE["statements"]),
        ("rows written per run", flat["cost.rows_written"], 1 + 9 + 3 + 6),
        ("bytes on disk per run (total size)", flat["cost.disk"], REFERENCE["bytes"]),
        ("dead row versions per run", flat["cost.dead"], REFERENCE["dead"]),
    ]
    for name, value, reference in rows:
        say(f"{name:34}  {value:>9.2f}  {reference:>9}  {'fewer' if value < reference else 'NOT fewer'}")


def report_payloads(figures: Figures) -> None:
    """Print the bytes per run of a document id and of the document carried in the context."""
    say("")
    say(
        f"bytes per three-step run carrying a document ({figures.runs} runs with its id,"
        f" {figures.input_runs} with it)"
    )
    say(f"{'the workflow carries':58}  {'on disk':>9}  {'live rows':>9}")
    for case, label in PAYLOAD_ROWS.items():
        values = figures.payloads[case]
        say(f"{label:58}  {values['disk']:>9,.0f}  {values['live']:>9,.0f}")


def report_inputs(figures: Figures) -> None:
    """Print the bytes per run of the input cases, by table."""
    say("")
    say(
        f"bytes per run with large inputs ({figures.input_runs} runs each; pg_total_relation_size,"
        " TOAST included)"
    )
    say(f"{'case':38}  " + "  ".join(f"{t:>16}" for t in SIZED) + f"  {'total':>9}")
    for case, label in INPUT_ROWS.items():
        sizes = figures.inputs[case]
        cells = "  ".join(f"{sizes[t]:>16,.0f}" for t in SIZED)
        say(f"{label:38}  {cells}  {sum(sizes.values()):>9,.0f}")


# The docs' blocks ---------------------------------------------------------------------------

BLOCK = re.compile(
    r"<!-- bench\.run_cost: (?P<name>\w+) -->\n(?P<body>.*?)\n?"
    r"<!-- /bench\.run_cost(?:: (?P<digest>\w+))? -->",
    re.DOTALL,
)


def digest(name: str, body: str) -> str:
    """What the closing marker of a block written by this script says of its text."""
    lines = "\n".join(line.rstrip() for line in body.strip().splitlines())
    return hashlib.sha256(f"{name}\n{lines}".encode()).hexdigest()[:12]


def count(value: float) -> str:
    """A count per run: ``5``, or ``5.05`` where runs differ."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def made(figures: Figures, when: date, what: str) -> str:
    """The block's first paragraph: when, by what command, of what."""
    threads = f"{figures.concurrency} worker thread" + ("s" if figures.concurrency > 1 else "")
    line = (
        f"Measured on {when.day} {when:%b %Y} by `{COMMAND}` ({what}; {threads}, autovacuum and"
        f" upkeep off, {figures.postgres}). Do not edit the figures by hand: run that command."
    )
    return textwrap.fill(line, width=100, break_long_words=False, break_on_hyphens=False)


def render_cost(figures: Figures, when: date) -> list[str]:
    flat = figures.flat()
    verbs = ", ".join(f"{verb} {count(n)}" for verb, n in figures.statements.items())
    keyed = ", ".join(f"{verb} {count(n)}" for verb, n in figures.keyed.items())
    written, dead, disk = [], [], []
    for t, v in figures.tables.items():
        parts = [
            f"{count(v[f])} {word}"
            for f, word in (("n_tup_ins", "inserted"), ("n_tup_upd", "updated"), ("n_tup_del", "deleted"))
            if v[f]
        ]
        if v["n_tup_upd"]:
            parts.append(f"{count(v['n_tup_hot_upd'])} of them HOT")
        if parts:
            written.append(f"`{t}` " + ", ".join(parts))
        if v["n_dead_tup"]:
            dead.append(f"`{t}` {count(v['n_dead_tup'])}")
        if round(v["total"]):
            disk.append(f"`{t}` {v['total']:,.0f}")
    live = f"run {figures.live['durable_runs']:,.0f}, steps {figures.live['durable_steps']:,.0f}"
    details = {
        "statements": verbs,
        "statements_keyed": keyed,
        "rows_written": "; ".join(written),
        "dead": ", ".join(dead),
        "disk": ", ".join(disk),
        "live": live,
    }
    rows = []
    for key, label in COST_ROWS.items():
        value = flat[f"cost.{key}"]
        shown = count(value) if f"cost.{key}" in EXACT else f"{value:,.0f}"
        rows.append([label, f"**{shown}**", details[key]])
    what = f"{figures.runs} runs of three no-op steps, inline continuation on, nothing pruned"
    return [made(figures, when, what), "", *table(["a three-step run", PER_RUN, "of which"], rows)]


def render_payloads(figures: Figures, when: date) -> list[str]:
    rows = [
        [label] + [f"{figures.payloads[case][k]:,.0f}" for k in PAYLOAD_COLUMNS]
        for case, label in PAYLOAD_ROWS.items()
    ]
    what = (
        f"three-step runs whose first step puts the input's `doc` in the context; {figures.runs}"
        f" runs with the id (and as many with the id and a WARNING line logged by each step),"
        f" {figures.input_runs} with the document; nothing pruned"
    )
    return [made(figures, when, what), "", *table(["the workflow carries", *PAYLOAD_COLUMNS.values()], rows)]


def render_inputs(figures: Figures, when: date) -> list[str]:
    flat = figures.flat()
    rows = []
    for case, label in INPUT_ROWS.items():
        cells = [f"{flat[f'inputs.{case}.{t}']:,.0f}" for t in SIZED]
        rows.append([label, *cells, f"**{flat[f'inputs.{case}.total']:,.0f}**"])
    what = (
        f"{figures.input_runs} runs per case; bytes per run, `pg_total_relation_size` deltas, TOAST and"
        " indexes included"
    )
    return [made(figures, when, what), "", *table(["case", *INPUT_COLUMNS.values()], rows)]


def render(figures: Figures, when: date) -> dict[str, str]:
    """Each block's text (between its markers), by name."""
    return {
        "cost": "\n".join(render_cost(figures, when)),
        "payloads": "\n".join(render_payloads(figures, when)),
        "inputs": "\n".join(render_inputs(figures, when)),
    }


def write_blocks(path: Path, blocks: dict[str, str]) -> list[str]:
    """Rewrite the blocks of ``path`` with ``blocks``; returns the names of those rewritten."""
    written: list[str] = []

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in blocks:
            raise click.ClickException(f"{path}: no block named {name!r} (there are {', '.join(BLOCKS)})")
        written.append(name)
        body = blocks[name]
        return f"<!-- bench.run_cost: {name} -->\n{body}\n<!-- /bench.run_cost: {digest(name, body)} -->"

    path.write_text(BLOCK.sub(replace, path.read_text()))
    return written


def read_blocks(document: str) -> list[tuple[str, str, str | None]]:
    """The blocks of a document: (name, body, digest of its closing marker, if any)."""
    return [(m["name"], m["body"], m["digest"]) for m in BLOCK.finditer(document)]


def cells(body: str) -> dict[str, dict[str, str]]:
    """A block's table: row label -> column header -> cell."""
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in body.splitlines()
        if line.strip().startswith("|") and not line.strip().startswith("|---")
    ]
    if not rows:
        return {}
    header = rows[0]
    return {row[0]: dict(zip(header[1:], row[1:], strict=False)) for row in rows[1:]}


def number(cell: str) -> float:
    """The first number of a cell (``**1,432**`` -> 1432.0)."""
    found = re.search(r"-?\d[\d,]*(?:\.\d+)?", cell)
    if not found:
        raise ValueError(f"no number in {cell!r}")
    return float(found[0].replace(",", ""))


def read_figures(name: str, body: str) -> dict[str, float]:
    """The figures a block shows, by ``block.key`` as ``Figures.flat`` names them."""
    table_ = cells(body)
    if name == "cost":
        return {f"cost.{k}": number(table_[label][PER_RUN]) for k, label in COST_ROWS.items()}
    rows, columns = (PAYLOAD_ROWS, PAYLOAD_COLUMNS) if name == "payloads" else (INPUT_ROWS, INPUT_COLUMNS)
    return {
        f"{name}.{case}.{column}": number(table_[label][header])
        for case, label in rows.items()
        for column, header in columns.items()
    }


def compare(shown: dict[str, float], measured: dict[str, float]) -> list[str]:
    """How figures shown in the docs differ from a measurement: exact ones must be equal, bytes
    within ``TOLERANCE`` of the figure (of its row's total, for a table's share of it)."""
    problems = []
    for key, value in shown.items():
        got = measured[key]
        if key in EXACT:
            if round(got, 2) != value:
                problems.append(f"{key}: the docs say {count(value)}, measured {got:.2f}")
            continue
        total = key.rsplit(".", 1)[0] + ".total"
        base = max(abs(shown.get(total, value)), 1.0)
        if abs(got - value) > TOLERANCE * base:
            problems.append(
                f"{key}: the docs say {value:,.0f}, measured {got:,.0f} (more than {TOLERANCE:.0%} off)"
            )
    return problems


if __name__ == "__main__":
    main()
