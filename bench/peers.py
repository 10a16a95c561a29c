"""durable_celery beside its peers: plain Celery chains, DBOS and procrastinate, same workloads.

    python -m bench.peers                 # 3 interleaved rounds (about 6 minutes on 2 cores)
    python -m bench.peers --quick         # a fast look: one small round (about a minute)
    python -m bench.peers --only durable,dbos --rounds 5
    python -m bench.peers --help

DBOS and procrastinate come with the ``[bench]`` extra (``pip install -e '.[bench]'``); a
system whose package is missing is skipped, saying so. Every system gets two worker processes
and a producer process of its own, on one PostgreSQL (a database of the bench's own,
``bench_peers_<random>``, dropped at the end; or ``--database-url``, used as is and left) and,
for Celery and durable, a ``redis-server`` of the bench's own:

- **plain Celery**: ``chain`` of three immutable signatures of one task, ``acks_late``,
  ``celery worker -P prefork -c 2``;
- **durable_celery**: a workflow of three steps, ``durable.start``, ``celery worker -P prefork
  -c 2`` with the defaults (inline continuation, upkeep, background publishing); a key is ``key=``;
- **DBOS**: a ``@DBOS.workflow`` of three ``@DBOS.step`` calls enqueued with ``DBOSClient`` on a
  queue, two processes with DBOS launched as queue workers; a key is the workflow ID;
- **procrastinate**: three ``async`` tasks, each deferring the next, two ``run_worker``
  processes; a key is a ``queueing_lock``.

Each step does nothing but note its start (``bench.peers_work``); the third counts its run
done in Redis. Per round, each measurement takes every system in turn (the order rotated each
round): throughput (runs/s and CPU per run: every process of the system, its PostgreSQL
backends and, for the Celery ones, the broker), latency at each ``--rates`` (start to first
step, step to step) and, with one-step runs, at each ``--one-step-rates`` (start to first step at
a rate whose three-step runs would be more than these cores can work: 500 a second on 2), and
keyed starts/s against a bare ``INSERT`` + ``COMMIT``. Medians over
rounds, ratios against plain Celery and durable's against each peer. bench/README.md says more.
This prints figures; it is not a test.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click
import psycopg
import redis

from bench import peers_phases as phases
from bench.common import private_redis, say
from bench.peers_measure import Meter, cpu_model, load_average, versions
from bench.peers_report import report
from bench.peers_systems import SPECS, Env, Running, Spec, available, prepare_schemas

SERVER = "postgresql://postgres@127.0.0.1:5432"
PACKAGES = ("durable-celery", "celery", "kombu", "dbos", "procrastinate", "psycopg", "sqlalchemy", "redis")
QUICK = {"runs": 200, "latency_runs": 100, "keyed": 200, "rounds": 1}


@contextmanager
def own_database(server: str, given: str | None) -> Iterator[str]:
    """The database to use: ``given`` as is, or a new ``bench_peers_<random>`` dropped after."""
    if given:
        yield given.replace("postgresql+psycopg://", "postgresql://")
        return
    name = f"bench_peers_{uuid.uuid4().hex[:8]}"
    admin = f"{server.rstrip('/')}/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    say(f"created database {name}")
    try:
        yield f"{server.rstrip('/')}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        say(f"dropped database {name}")


def backends_finder(database_url: str) -> Any:
    """A function from client ports to the pids of the PostgreSQL backends serving them."""
    conn = psycopg.connect(database_url, autocommit=True)

    def find(ports: set[int]) -> list[int]:
        if not ports:
            return []
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE client_port = ANY(%s)", (list(ports),))
        return [int(row[0]) for row in rows]

    find.close = conn.close  # type: ignore[attr-defined]
    return find


def start_systems(stack: ExitStack, specs: list[Spec], env: Env, client: redis.Redis) -> dict[str, Running]:
    """Start every system's workers, then its producer; stopped when ``stack`` closes."""
    running = {}
    for spec in specs:
        say(f"starting {spec.label}: workers, then its producer")
        run = Running(spec, env)
        stack.callback(run.stop)
        run.start_workers(client)
        run.start_producer()
        running[spec.name] = run
    return running


def _cpu(cpu: dict[str, float]) -> str:
    """CPU ms a run, in all and by part."""
    return (
        f"CPU {cpu['all']:.2f} ms/run (workers {cpu['workers']:.2f}, producer {cpu['producer']:.2f},"
        f" PostgreSQL {cpu['postgres']:.2f}, Redis {cpu['redis']:.2f})"
    )


def one_round(
    number: int, specs: list[Spec], running: dict[str, Running], ctx: phases.Context, opts: dict[str, Any]
) -> None:
    """Every measurement once, each taking the systems in turn (the order rotated per round)."""
    results = opts["results"]
    shift = (number - 1) % len(specs)
    order = specs[shift:] + specs[:shift]
    head = f"round {number}/{opts['rounds']}"
    say(f"{head}: load average {load_average()}")
    capacity = {}
    for spec in order:
        row = phases.throughput(ctx, running[spec.name], opts["runs"], opts["threads"])
        capacity[spec.name] = row["rate"]
        results["throughput"].setdefault(spec.name, []).append(row)
        say(f"  {head}, throughput, {spec.label}: {row['rate']:.1f} runs/s, {_cpu(row['cpu'])}")
    for rate, steps in opts["rates"]:
        for spec in order:
            key = (spec.name, rate, steps)
            shown = f"{rate:g}/s" + (" of one-step runs" if steps == 1 else "")
            # A later rate above what the system worked in throughput (steps a second) is skipped.
            if 3 * capacity[spec.name] < rate * steps and (rate, steps) != opts["rates"][0]:
                skipped = f"below {rate * steps:g} steps/s in throughput ({3 * capacity[spec.name]:.0f}/s)"
                results["latency"].setdefault(key, []).append({"skipped": skipped})
                say(f"  {head}, latency at {shown}, {spec.label}: not run, {skipped}")
                continue
            row = phases.latency(ctx, running[spec.name], opts["latency_runs"], rate, steps)
            results["latency"].setdefault(key, []).append(row)
            between = f" step to step p50 {row['step_p50']:.1f} ms, p99 {row['step_p99']:.1f} ms;"
            between = between if steps > 1 else ""
            say(
                f"  {head}, latency at {shown}, {spec.label}: start to 1st step"
                f" p50 {row['first_p50']:.1f} ms, p99 {row['first_p99']:.1f} ms;{between}"
                f" {row['achieved']:.0f} starts/s, worked {row['worked']:.0f}/s,"
                f" {'kept up' if row['kept_up'] else 'BEHIND'}; {_cpu(row['cpu'])}"
            )
    bare = phases.bare(ctx, opts["keyed"])
    results["bare"].append(bare)
    say(f"  {head}, keyed, bare INSERT + COMMIT: {bare['rate']:.0f}/s")
    for spec in order:
        if spec.name == "plain":
            continue
        row = phases.keyed(ctx, running[spec.name], opts["keyed"])
        results["keyed"].setdefault(spec.name, []).append(row)
        say(
            f"  {head}, keyed, {spec.label}: {row['rate']:.0f} starts/s"
            f" ({row['rate'] / bare['rate']:.2f}x bare)"
        )


def choose(only: str) -> tuple[list[Spec], list[tuple[Spec, str]]]:
    """The systems to run, and those skipped with why."""
    wanted = {name.strip() for name in only.split(",") if name.strip()}
    unknown = wanted - {spec.name for spec in SPECS}
    if unknown:
        raise click.BadParameter(f"no system named {', '.join(sorted(unknown))}", param_hint="--only")
    specs, skipped = [], []
    for spec in SPECS:
        if spec.name not in wanted:
            continue
        if available(spec):
            specs.append(spec)
        else:
            reason = f"package {spec.package!r} not installed (pip install -e '.[bench]')"
            skipped.append((spec, reason))
            say(f"skipping {spec.label}: {reason}")
    return specs, skipped


def run_bench(specs: list[Spec], opts: dict[str, Any]) -> None:
    """Set everything up, warm up, run the rounds, print the report, tear everything down."""
    load_start = load_average()
    with (
        own_database(opts["server"], opts["database_url"]) as url,
        private_redis() as broker,
        tempfile.TemporaryDirectory(prefix="bench-peers-") as folder,
        ExitStack() as stack,
    ):
        client = redis.Redis.from_url(broker)
        stack.callback(client.close)
        prepare_schemas(url, [s.name for s in specs], broker)
        env = Env(url, broker, Path(folder), opts["concurrency"], opts["peer_concurrency"], opts["dbos_poll"])
        running = start_systems(stack, specs, env, client)
        finder = backends_finder(url)
        stack.callback(finder.close)
        redis_pid = int(client.info("server")["process_id"])
        ctx = phases.Context(client, Meter(finder), phases.StepLog(Path(folder)), url, redis_pid)
        for spec in specs:
            say(f"warming up {spec.label}")
            phases.throughput(ctx, running[spec.name], 20, opts["threads"])
        began = time.perf_counter()
        for number in range(1, opts["rounds"] + 1):
            one_round(number, specs, running, ctx, opts)
            say(f"  ({time.perf_counter() - began:.0f}s)")
        server = client.info("server")["redis_version"]
        with psycopg.connect(url) as conn:
            postgres = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    facts = {
        **opts,
        "cpu": cpu_model(),
        "load_start": load_start,
        "load_end": load_average(),
        "versions": {**versions(PACKAGES), "PostgreSQL": postgres.split()[0], "redis-server": server},
        "settings": (
            f"{opts['concurrency']} worker processes per system; DBOS worker_concurrency"
            f" {opts['peer_concurrency']} and queue polling every {opts['dbos_poll']:g} s; procrastinate"
            f" concurrency {opts['peer_concurrency']}"
        ),
    }
    report(specs, opts["results"], facts, opts["rates"])


@click.command()
@click.option(
    "--runs",
    "-n",
    default=1000,
    show_default=True,
    type=click.IntRange(10),
    help="Throughput runs per system per round.",
)
@click.option(
    "--latency-runs",
    default=500,
    show_default=True,
    type=click.IntRange(10),
    help="Runs per system per rate per round.",
)
@click.option(
    "--rates",
    default="50",
    show_default=True,
    help="Steady start rates of three-step runs (runs/s), comma-separated; a later one above a"
    " system's runs/s is skipped.",
)
@click.option(
    "--one-step-rates",
    default="500",
    show_default=True,
    help="Steady start rates of one-step runs, comma-separated (empty: none); one above a system's"
    " steps/s is skipped.",
)
@click.option(
    "--keyed",
    default=1000,
    show_default=True,
    type=click.IntRange(10),
    help="Keyed starts per system per round.",
)
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1), help="Interleaved rounds.")
@click.option(
    "--threads",
    default=4,
    show_default=True,
    type=click.IntRange(1),
    help="Producer threads starting throughput runs.",
)
@click.option(
    "--concurrency",
    "-c",
    default=2,
    show_default=True,
    type=click.IntRange(1),
    help="Worker processes per system.",
)
@click.option(
    "--peer-concurrency",
    default=16,
    show_default=True,
    type=click.IntRange(1),
    help="DBOS worker_concurrency and procrastinate concurrency, per process.",
)
@click.option(
    "--dbos-poll",
    default=0.1,
    show_default=True,
    type=click.FloatRange(0.001),
    help="DBOS queue polling interval, seconds (DBOS's default is 1).",
)
@click.option("--only", default=",".join(s.name for s in SPECS), show_default=True, help="Systems to run.")
@click.option(
    "--server", default=SERVER, show_default=True, help="PostgreSQL server for the bench's own database."
)
@click.option("--database-url", default=None, help="Use this database (not dropped) instead of a new one.")
@click.option(
    "--quick", is_flag=True, help="A fast look: 200 runs, 100 per rate, 200 keyed starts, one round."
)
def main(**opts: Any) -> None:
    """durable_celery, plain Celery chains, DBOS and procrastinate: runs/s, CPU/run, latency, keyed starts."""
    if opts.pop("quick"):
        opts.update(QUICK)
    opts["rates"] = [(float(rate), 3) for rate in opts["rates"].split(",") if rate.strip()] + [
        (float(rate), 1) for rate in opts.pop("one_step_rates").split(",") if rate.strip()
    ]
    specs, skipped = choose(opts.pop("only"))
    if not specs:
        say("nothing to run")
        return
    opts["skipped"] = skipped
    opts["results"] = {"throughput": {}, "latency": {}, "keyed": {}, "bare": []}
    run_bench(specs, opts)


if __name__ == "__main__":
    main()
