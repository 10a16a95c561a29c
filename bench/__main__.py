"""Every bench in turn, then all their figures and targets together, in one run.

    python -m bench                      # about 2 minutes: the figures docs/performance.md shows
    python -m bench --only prefork,keys  # some of them
    python -m bench --quick              # smaller sizes, to see that everything runs (under a minute)

Each bench runs as ``python -m bench.<name>`` in a process of its own (so one's workers, pools
and Redis server are gone before the next starts), its output shown as it comes; at the end,
each one's report (what it prints after its progress) is shown again, one after the other.
``--quick`` sizes are too small for the targets: read its figures as a smoke test only.

This prints figures; it is not a test. It exits with 1 if a bench itself failed to run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

import click

from bench.common import say


@dataclass(frozen=True)
class Bench:
    """One bench: its module, what it measures, and its arguments for a full and a quick run."""

    name: str
    what: str
    full: tuple[str, ...]
    quick: tuple[str, ...]


BENCHES = (
    Bench(
        "prefork",
        "runs/s of durable runs (inline on and off) against plain Celery chains, prefork workers;"
        " statements per run",
        ("-n", "1500"),
        ("-n", "150", "--rounds", "1"),
    ),
    Bench(
        "keys",
        "keyed starts (new key, duplicate) against a bare INSERT + COMMIT, statements per start",
        (),
        ("--count", "300", "--hammer-seconds", "1"),
    ),
    Bench("prune", "pruning 100,000 runs with 300,000 step rows", (), ("--runs", "10000")),
    Bench(
        "claims",
        "claim latency: no history / 500,000 finished / 500,000 ready runs",
        (),
        ("--finished", "20000", "--ready", "20000", "--claims", "300", "--rounds", "2"),
    ),
    Bench(
        "flow",
        "flow control: claims with 10,000 runs parked for a slot, rate-limited starts",
        (),
        ("--parked", "1000", "--other-keys", "100", "--claims", "200", "--starts", "100", "--rounds", "2"),
    ),
    Bench(
        "fair",
        "fair share and priority: small tenants' waits behind a 10,000-run backlog, weights' shares",
        (),
        ("--backlog", "300", "--small", "3", "--stream-s", "3", "--prefill", "50"),
    ),
    Bench(
        "batch",
        "batches: starts gathered by batch key against one run per start, lines handled a second",
        (),
        ("-n", "300", "--keys", "10", "--period", "0.3"),
    ),
    Bench(
        "peers",
        "durable beside plain Celery chains, DBOS and procrastinate (the [bench] extra): runs/s, CPU"
        " per run, start-to-first-step latency, keyed starts",
        (),
        ("--quick",),
    ),
    Bench(
        "atomic",
        "an atomic step against a plain one: statements and round trips per step, runs/s",
        (),
        ("-n", "200", "--rounds", "1", "--count", "40"),
    ),
    Bench(
        "pool",
        "the pool-size table: runs/s and pool waits at pool_size 5/10/20/50",
        (),
        ("--runs", "60", "--rounds", "1"),
    ),
    Bench(
        "answers",
        "waiting for answers: statements while 1 and 1,000 callers wait, a run's end to result()",
        (),
        ("--waiters", "1,100", "--window", "1", "--runs", "60"),
    ),
    Bench(
        "volume",
        "every read, report, page and upkeep pass at 100,000 and 1,000,000 runs (built, then dropped;"
        " the 10,000,000-run figures: python -m bench.volume, bench/README.md)",
        ("time", "--runs", "100k", "--runs", "1m", "--rounds", "3"),
        ("time", "--runs", "10k", "--runs", "40k", "--rounds", "1", "--no-admin"),
    ),
)
NAMES = tuple(bench.name for bench in BENCHES)


def run(bench: Bench, quick: bool) -> tuple[int, list[str]]:
    """Run one bench, echoing its output; returns its exit status and its report lines."""
    args = bench.quick if quick else bench.full
    command = [sys.executable, "-m", f"bench.{bench.name}", *args]
    say(f"$ {' '.join(['python', *command[1:]])}")
    lines: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            say(f"  {line}")
            lines.append(line)
    # A bench prints its progress, then an empty line, then its report.
    report = lines[lines.index("") + 1 :] if "" in lines else lines[-20:]
    return proc.returncode, report


@click.command()
@click.option(
    "--only",
    default=",".join(NAMES),
    show_default=True,
    help="Benches to run, comma-separated, in this order.",
)
@click.option("--quick", is_flag=True, help="Small sizes: checks that every bench runs, not the targets.")
def main(only: str, quick: bool) -> None:
    """Every bench in turn (the order of --only), then their reports together."""
    chosen = [name.strip() for name in only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(NAMES))
    if unknown:
        raise click.BadParameter(f"no bench named {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    benches = [bench for bench in BENCHES if bench.name in chosen]
    began = time.perf_counter()
    reports: list[tuple[Bench, int, list[str]]] = []
    for number, bench in enumerate(benches, 1):
        say(f"[{number}/{len(benches)}] {bench.name}: {bench.what}  ({time.perf_counter() - began:.0f}s)")
        status, report = run(bench, quick)
        reports.append((bench, status, report))
        say("")
    say("=" * 100)
    say(f"all figures ({'--quick: not comparable with the targets' if quick else 'one run'}),")
    say(f"{time.perf_counter() - began:.0f}s in all")
    failed = []
    for bench, status, report in reports:
        say("")
        say(f"== {bench.name}: {bench.what}")
        for line in report:
            say(f"   {line}")
        if status != 0:
            failed.append(bench.name)
            say(f"   (bench.{bench.name} exited with {status})")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
