"""Every read and upkeep pass at 100,000 and 10,000,000 runs (issue 42).

    python -m bench.volume build --runs 100k                  # bench_volume_100k, about 15 s
    python -m bench.volume build --runs 10m                   # bench_volume_10m, about 15 min
    python -m bench.volume time --db bench_volume_100k --db bench_volume_10m
    python -m bench.volume time --db bench_volume_100k --db bench_volume_10m --explain
    python -m bench.volume history --db bench_volume_10m      # pruning, vacuum, partitions
    python -m bench.volume list
    python -m bench.volume drop bench_volume_100k

``build`` makes a database of its own on ``--server`` (named ``bench_volume_<size>``), migrates
it with the library and fills it set-based (``bench/volume_build.py``, ``volume_sql.py``): runs
of eight workflows over 30 days with their steps, key rows, events, a week of activity, and
3,000 unfinished runs (ready, running, parked for a slot, waiting for events, sleeping, backing
off, parents waiting for children). Built databases are kept for reuse; ``drop`` drops only
databases this bench made (their names start with ``bench_volume_`` and their COMMENT says so).

``time`` (``bench/volume_time.py``) times every public read, CLI report, dashboard page and
JSON route, admin changelist, metrics scrape and upkeep pass on each database, in interleaved
rounds, and prints medians, the ratio of the largest to the smallest and the goals missed;
``--explain`` adds ``EXPLAIN (ANALYZE, BUFFERS)`` of the statements that grow. Given ``--runs``
instead of ``--db`` it builds scratch databases first and drops them after (unless ``--keep``).
"""

from __future__ import annotations

import re
import sys

import click

from bench.common import say
from bench.volume_build import PREFIX, SERVER, Builder, bench_databases, drop_database, read_mark
from bench.volume_sql import ACTIVE

SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kKmM]?)$")


def parse_size(value: str) -> int:
    """A run count: ``100000``, ``100k``, ``10m``, ``1.5m``."""
    found = SIZE.match(value.replace(",", "").replace("_", ""))
    if not found:
        raise click.BadParameter(f"{value!r} is not a number of runs (e.g. 100k, 10m)")
    number, unit = float(found.group(1)), found.group(2).lower()
    return int(number * {"": 1, "k": 1_000, "m": 1_000_000}[unit])


def size_name(runs: int) -> str:
    """``100k``, ``10m``, ``1.5m``: a run count for a database name."""
    if runs >= 1_000_000 and runs % 100_000 == 0:
        return f"{runs / 1_000_000:g}m".replace(".", "_")
    if runs >= 1_000 and runs % 1_000 == 0:
        return f"{runs // 1_000}k"
    return str(runs)


def database_name(name: str | None, runs: int) -> str:
    """The database's full name: ``bench_volume_`` and ``name`` (or the size)."""
    name = name or size_name(runs)
    return name if name.startswith(PREFIX) else PREFIX + name


def build_one(server: str, name: str, runs: int, active: int, workers: int) -> dict:
    """Build one database and print what it holds."""
    builder = Builder(server, name, runs, active, say, workers)
    say(
        f"building {name}: {builder.runs:,} runs ({builder.active:,} unfinished) over 30 days "
        f"on {server}, {workers} loader connection(s)"
    )
    info = builder.run()
    say("")
    gib, per_run = info["bytes"] / 2**30, info["bytes_per_run"]
    say(f"built {name} in {info['seconds']:.0f} s: {gib:.2f} GiB, {per_run:,} bytes a run")
    say(f"{'table':18} {'rows':>12} {'heap MiB':>10} {'index MiB':>10} {'total MiB':>10} {'B/run':>7}")
    for table, s in info["sizes"].items():
        say(
            f"{table:18} {s['rows']:>12,} {s['heap'] / 2**20:>10,.1f} {s['indexes'] / 2**20:>10,.1f} "
            f"{s['total'] / 2**20:>10,.1f} {s['total'] / info['runs']:>7,.0f}"
        )
    return info


@click.group()
def main() -> None:
    """Volume databases of N runs, and the time of every read and upkeep pass on them."""


@main.command()
@click.option("--runs", "-n", "runs_text", required=True, help="Runs to build: 100k, 1m, 10m ...")
@click.option("--db", "name", help="Database name (bench_volume_ is prefixed); default bench_volume_<size>.")
@click.option("--active", default=ACTIVE, show_default=True, help="Unfinished runs (at most a twentieth).")
@click.option("--workers", default=2, show_default=True, help="Connections loading chunks at once.")
@click.option("--replace", is_flag=True, help="Drop a database of that name this bench made first.")
@click.option("--server", default=SERVER, show_default=True, help="PostgreSQL server (trust auth).")
def build(runs_text: str, name: str | None, active: int, workers: int, replace: bool, server: str) -> None:
    """Build a database of N runs in the shape the library writes; it is kept (see drop)."""
    runs = parse_size(runs_text)
    full = database_name(name, runs)
    if read_mark(server, full) is not None:
        if not replace:
            raise click.ClickException(f"{full} exists (built by this bench): use it, or --replace")
        drop_database(server, full)
        say(f"dropped {full}")
    build_one(server, full, runs, active, workers)
    say(f"kept {full}: python -m bench.volume time --db {full}; python -m bench.volume drop {full}")


@main.command(name="list")
@click.option("--server", default=SERVER, show_default=True)
def list_command(server: str) -> None:
    """The databases this bench made, with what each holds."""
    found = bench_databases(server)
    if not found:
        say("no volume databases")
    for name, info in sorted(found.items()):
        state = "complete" if info.get("complete") else "UNFINISHED (a build stopped: drop it)"
        size = f"{info.get('bytes', 0) / 2**30:.2f} GiB" if info.get("bytes") else "?"
        built = info.get("built_at", "?")
        say(f"{name:30} {info.get('runs', 0):>12,} runs  {size:>10}  built {built}  {state}")


@main.command()
@click.argument("names", nargs=-1, required=True)
@click.option("--server", default=SERVER, show_default=True)
def drop(names: tuple[str, ...], server: str) -> None:
    """Drop databases this bench made (never another)."""
    failed = False
    for name in names:
        full = name if name.startswith(PREFIX) else PREFIX + name
        if drop_database(server, full):
            say(f"dropped {full}")
        else:
            say(f"not dropped: {full} is not a database this bench made")
            failed = True
    if failed:
        sys.exit(1)


@main.command()
@click.option("--db", "names", multiple=True, required=True, help="A database this bench made.")
@click.option("--server", default=SERVER, show_default=True)
def migrate(names: tuple[str, ...], server: str) -> None:
    """Apply the library's pending revisions to built databases (e.g. new indexes), then ANALYZE."""
    from bench.volume_time import migrate_database

    for name in names:
        full = database_name(name, 0)
        if read_mark(server, full) is None:
            raise click.ClickException(f"{full} is not a database this bench made")
        migrate_database(server, full)


def _register_more() -> None:
    """The ``time``, ``plans`` and ``history`` commands (modules of their own)."""
    from bench.volume_history import history
    from bench.volume_plans import plans
    from bench.volume_time import time_command

    main.add_command(time_command)
    main.add_command(history)
    main.add_command(plans)


_register_more()


if __name__ == "__main__":
    main()
