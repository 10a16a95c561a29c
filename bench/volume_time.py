"""``python -m bench.volume time``: every op (volume_ops.py) on each database, in rounds.

Each round first moves the databases' unfinished runs to now (``volume_app.refresh``, untimed),
then takes the ops in turn, each on every database one after the other (the order of the
databases alternating from round to round), so that load from elsewhere on the machine falls on
every size alike. One untimed call of each op on each database comes first (a first call pays
for imports, templates and cold pages). Reported per op: the median over the rounds per
database, the ratio of the largest database's median to the smallest's, and the goals of issue
42 it misses: more than ``RATIO_GOAL`` times slower, a dashboard page, JSON route or admin
changelist over ``PAGE_GOAL_MS``, an upkeep pass over ``UPKEEP_GOAL_MS``.

``--explain`` then captures the statements of every op that missed a goal, on each database,
and prints ``EXPLAIN (ANALYZE, BUFFERS)`` on the largest of each statement whose execution time
grew more than ``RATIO_GOAL`` times (and takes over a millisecond there), in a transaction rolled
back.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import click

from bench.common import say
from bench.volume_app import make_durable, refresh
from bench.volume_build import PREFIX, SERVER, admin_url, read_mark, write_mark
from bench.volume_ops import Capture, Op, Target, explainable, operations, pick_sample, plan_of

RATIO_GOAL = 2.0
PAGE_GOAL_MS = 300.0
UPKEEP_GOAL_MS = 20.0
EXPLAIN_FLOOR_MS = 1.0


@dataclass
class Result:
    """One op's times (ms) per database label, and its error if it failed."""

    name: str
    group: str
    times: dict[str, list[float]] = field(default_factory=dict)
    error: str | None = None

    def median(self, label: str) -> float | None:
        """The median time on database ``label``, None without one."""
        found = self.times.get(label)
        return statistics.median(found) if found else None


def misses(result: Result, small: str, large: str) -> list[str]:
    """The goals ``result`` misses at the largest database."""
    if result.error:
        return ["ERROR"]
    low, high = result.median(small), result.median(large)
    flags = []
    if low and high and small != large and high / low > RATIO_GOAL:
        flags.append(f">{RATIO_GOAL:g}x")
    if high is not None and result.group in ("page", "api", "admin") and high > PAGE_GOAL_MS:
        flags.append(f">{PAGE_GOAL_MS:g}ms")
    if high is not None and result.group == "upkeep" and high > UPKEEP_GOAL_MS:
        flags.append(f">{UPKEEP_GOAL_MS:g}ms")
    return flags


def migrate_database(server: str, name: str) -> list[str]:
    """Apply pending revisions to a built database with the library, ANALYZE, note them."""
    from celery import Celery

    from durable_celery import Durable

    durable = Durable(
        Celery("bench_volume_migrate", broker="memory://"), admin_url(server, name), upkeep=False
    )
    try:
        applied = durable.migrate(progress=lambda line: say(f"  {name}: {line}"))
        with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE")
    finally:
        durable.db.dispose()
    mark = read_mark(server, name) or {}
    mark["revisions"] = sorted(set(mark.get("revisions", [])) | set(applied))
    import psycopg

    with psycopg.connect(admin_url(server), autocommit=True) as conn:
        write_mark(conn, name, mark)
    say(f"{name}: applied {', '.join(applied) or 'nothing (up to date)'}")
    return applied


def open_target(server: str, name: str) -> Target:
    """The Durable, sample and dashboard client of database ``name`` (a complete build)."""
    mark = read_mark(server, name)
    if mark is None or not mark.get("complete"):
        raise click.ClickException(f"{name} is not a complete volume database (python -m bench.volume list)")
    label = name[len(PREFIX) :] if name.startswith(PREFIX) else name
    durable = make_durable(admin_url(server, name), label)
    pending = durable.pending_migrations()
    if pending:
        say(
            f"NOTE {name} lacks revision(s) {', '.join(pending)} of this checkout: "
            f"python -m bench.volume migrate --db {name}"
        )
    refresh(durable)
    return Target(durable, pick_sample(durable), label, int(mark.get("runs", 0)), name)


def timed(op: Op, target: Target) -> tuple[float, str | None]:
    """One call of ``op`` on ``target``: milliseconds, and the error if it raised."""
    began = time.perf_counter()
    try:
        op.call(target)
    except Exception as exc:  # an op broken by a change elsewhere: reported, the rest go on
        return (time.perf_counter() - began) * 1000, f"{type(exc).__name__}: {str(exc)[:300]}"
    return (time.perf_counter() - began) * 1000, None


def run_rounds(ops: list[Op], targets: list[Target], rounds: int, admin: bool) -> dict[str, Result]:
    """Warm up, then ``rounds`` interleaved rounds; the results by op name."""
    results = {op.name: Result(op.name, op.group) for op in ops}
    say(f"warm-up: every op once on {', '.join(t.label for t in targets)}")
    for op in ops:
        for target in targets:
            _, error = timed(op, target)
            if error:
                results[op.name].error = error
                say(f"  {op.name} on {target.label}: {error}")
    for number in range(rounds):
        began = time.perf_counter()
        order = targets if number % 2 == 0 else list(reversed(targets))
        for target in targets:
            refresh(target.durable)
        for op in ops:
            for target in order:
                ms, error = timed(op, target)
                results[op.name].times.setdefault(target.label, []).append(ms)
                if error:
                    results[op.name].error = error
        if admin:
            admin_round(results, order)
        say(f"round {number + 1}/{rounds} in {time.perf_counter() - began:.0f}s")
    return results


def admin_round(results: dict[str, Result], targets: list[Target]) -> None:
    """One round of the Django admin's changelists, in a process per database (volume_admin.py)."""
    for target in targets:
        command = [sys.executable, "-m", "bench.volume_admin", "--db", target.database]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            error = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            result = results.setdefault("admin", Result("admin", "admin"))
            result.error = f"bench.volume_admin failed: {error[0][:300]}"
            continue
        for view, ms in json.loads(lines[-1])["times"].items():
            result = results.setdefault(view, Result(view, "admin"))
            result.times.setdefault(target.label, []).append(ms)


def report(results: dict[str, Result], targets: list[Target]) -> list[dict[str, Any]]:
    """Print the table; returns its rows (for --json)."""
    small, large = targets[0].label, targets[-1].label
    labels = [t.label for t in targets]
    say("")
    say(
        f"{'operation':46} {'group':7} "
        + " ".join(f"{label + ' ms':>10}" for label in labels)
        + "      x  missed"
    )
    rows = []
    for result in results.values():
        medians = {label: result.median(label) for label in labels}
        low, high = medians[small], medians[large]
        ratio = high / low if low and high else None
        flags = misses(result, small, large)
        cells = " ".join(f"{m:>10.1f}" if m is not None else f"{'-':>10}" for m in medians.values())
        shown_ratio = f"{ratio:6.1f}" if ratio is not None else f"{'-':>6}"
        say(f"{result.name[:46]:46} {result.group:7} {cells} {shown_ratio}  {' '.join(flags)}")
        if result.error:
            say(f"{'':55}{result.error[:150]}")
        rows.append({"name": result.name, "group": result.group, "ms": medians, "x": ratio, "missed": flags})
    say("")
    missed = [r for r in rows if r["missed"]]
    say(
        f"goals at {large} (<= {RATIO_GOAL:g}x {small}; pages, routes, changelists <= {PAGE_GOAL_MS:g} ms; "
        f"upkeep passes <= {UPKEEP_GOAL_MS:g} ms): {len(rows) - len(missed)} of {len(rows)} met"
    )
    return rows


EXECUTION = re.compile(r"Execution Time: ([\d.]+) ms")


def explain_growth(ops: list[Op], targets: list[Target], flagged: set[str]) -> None:
    """EXPLAIN (ANALYZE, BUFFERS) on the largest database of each flagged op's statements that grew."""
    small, large = targets[0], targets[-1]
    say("")
    say(
        f"== EXPLAIN (ANALYZE, BUFFERS) on {large.label} of the statements that grew "
        f"(> {RATIO_GOAL:g}x {small.label})"
    )
    for op in ops:
        if op.name not in flagged:
            continue
        captured = {}
        for target in (small, large):
            capture = Capture([target.durable.db.engine])
            try:
                with capture.during() as statements:
                    timed(op, target)
                captured[target.label] = [s for s in statements if explainable(s[0])]
            finally:
                capture.close()
        _explain_pairs(op, small, large, captured[small.label], captured[large.label])


def _explain_pairs(op: Op, small: Target, large: Target, before: list[Any], after: list[Any]) -> None:
    """Compare each statement's execution time on both databases; print the grown ones' plans."""
    seen = set()
    for (statement, params_small), (statement_large, params_large) in zip(before, after, strict=False):
        if statement != statement_large or statement in seen:
            continue
        seen.add(statement)
        low = _execution_ms(plan_of(small.durable, statement, params_small, analyze=True))
        plan = plan_of(large.durable, statement, params_large, analyze=True)
        high = _execution_ms(plan)
        if high < EXPLAIN_FLOOR_MS or (low and high / low <= RATIO_GOAL):
            continue
        say("")
        say(f"-- {op.name}: {low:.2f} ms at {small.label}, {high:.2f} ms at {large.label}")
        say(" ".join(statement.split())[:1500])
        for line in plan.splitlines():
            say(f"   {line}")


def _execution_ms(plan: str) -> float:
    """The execution time an EXPLAIN ANALYZE text reports."""
    found = EXECUTION.search(plan)
    return float(found.group(1)) if found else 0.0


@click.command(name="time")
@click.option("--db", "names", multiple=True, help="A built database (repeat: smallest first).")
@click.option("--runs", "sizes", multiple=True, help="Build scratch databases of these sizes instead.")
@click.option("--keep", is_flag=True, help="Keep the scratch databases --runs built.")
@click.option("--rounds", default=5, show_default=True, help="Timed rounds (medians of these).")
@click.option("--only", help="Only ops whose name or group contains this text.")
@click.option("--explain", is_flag=True, help="EXPLAIN (ANALYZE, BUFFERS) of the statements that grow.")
@click.option("--no-admin", is_flag=True, help="Leave out the Django admin's changelists.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the table as JSON here.")
@click.option("--server", default=SERVER, show_default=True)
def time_command(
    names: tuple[str, ...],
    sizes: tuple[str, ...],
    keep: bool,
    rounds: int,
    only: str | None,
    explain: bool,
    no_admin: bool,
    json_path: str | None,
    server: str,
) -> None:
    """Time every read, report, page, changelist, scrape and upkeep pass on each database."""
    from bench.volume import build_one, database_name, parse_size
    from bench.volume_build import drop_database

    built = []
    if sizes:
        import uuid

        for size in sizes:
            runs = parse_size(size)
            name = database_name(f"{size}_{uuid.uuid4().hex[:6]}", runs)
            build_one(server, name, runs, 3000, 2)
            built.append(name)
    full = [database_name(n, 0) for n in names] + built
    if not full:
        raise click.UsageError("give --db (built databases) or --runs (sizes to build)")
    try:
        targets = sorted((open_target(server, n) for n in full), key=lambda t: t.runs)
        ops = [op for op in operations() if not only or only in op.name or only == op.group]
        admin = not no_admin and (not only or only == "admin")
        say(f"{len(ops)} ops{' and the admin changelists' if admin else ''}, {rounds} rounds")
        results = run_rounds(ops, targets, rounds, admin)
        rows = report(results, targets)
        if json_path:
            with open(json_path, "w", encoding="utf-8") as out:
                json.dump({"databases": [t.label for t in targets], "rows": rows}, out, indent=1)
        if explain:
            flagged = {r["name"] for r in rows if r["missed"] and r["group"] != "admin"}
            explain_growth(ops, targets, flagged)
    finally:
        for name in built:
            if keep:
                say(f"kept {name}")
            else:
                drop_database(server, name)
                say(f"dropped {name}")
