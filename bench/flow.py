"""What flow control costs a claim and a start: with no runs waiting, and with 10,000 parked.

    python -m bench.flow [--parked 10000] [--claims 2000] [--rounds 5] [--starts 1000]

Issue 32: "The claim stays flat: a bench shows claims with 10,000 runs waiting for slots cost no
more than without". Three scratch databases are made (``bench_ops_flow_*``), runs bulk-loaded
with one ``INSERT ... SELECT generate_series`` each, then ``VACUUM ANALYZE`` (and autovacuum off
on the runs table, so that no pass of it lands in one side's round only):

- ``empty``: ``RUNNING`` steps of the measured key executing (``locked_by`` set), ``SLOT_LIMIT``
  of a key that is full, and ``--running`` of other keys (other workers' steps), and as many
  finished runs of those keys as ``parked`` has waiting: the two tables are the same size (the
  planner reads their statistics for every statement), only whether runs wait differs;
- ``parked``: the same, plus ``--parked`` runs of the measured key parked for a slot
  (``flow_wait='slot'``, ``due_at`` NULL, started after the runs claimed, as the line behind a
  woken run is), ``--parked`` of the full key, and ``--parked`` on ``--other-keys`` other keys;
- ``rate``: ``--parked`` starts of one rate key inside its window (``rate_limit`` 100,000 per hour)
  and as many of a key whose limit (10 per hour) they exceed.

Claims (each case's runs are inserted pending and due, then claimed one at a time; only the
claim is timed; a claimed run is then finished by an untimed ``UPDATE`` so that its slot is free
for the next, on every side alike):

- (a) a workflow without limits, ``empty``: ``queries.claim_run`` (one autocommit ``UPDATE``);
- (b) a workflow with ``concurrency`` (``SLOT_LIMIT`` per key), ``empty``: ``flow.claim``, the
  worker's own path for such a workflow; ``RUNNING`` of the key's slots are in use, so it gets one;
- (c) the same in ``parked``: ``--parked`` runs of the key waiting behind it;
- (d) (a) in ``parked``: a plain workflow beside the parked runs of another;
- refused: ``flow.claim`` of a run whose key has every slot taken (``empty``) or whose line is
  ``--parked`` long (``parked``): the claim parks it (and writes its ``slot_wait`` entry).

Starts (``durable.start()`` with a recording outbox: the database's part only): a workflow
without limits; one with ``rate_limit`` on a key of its own each time (an empty window); on the
key with ``--parked`` starts in its window; and a start refused with ``RateLimited``.

Rounds alternate between the cases, so load from elsewhere on the machine falls on all alike.
Statements per call come from a separate, untimed pass (``before_cursor_execute``). Prints the
median and p95 per case, the ratios (c)/(b) and (d)/(a) against ``RATIO_TARGET`` (and, for
scale, what a rate limit's window costs: its count reads up to ``limit`` starts) and the
statements per call. The databases are dropped.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import click
from celery import Celery
from sqlalchemy import event, text

from bench.common import run_id_sql, say
from bench.scratch import SERVER, Timer, scratch_database
from durable_celery import Durable, RateLimited
from durable_celery.core import flow
from durable_celery.store import queries
from durable_celery.testing import RecordingOutbox

RATIO_TARGET = 1.1
SLOT_LIMIT = 4  # the concurrency limit per key
RUNNING = 3  # steps of the measured key running: one slot free for the claim
MEASURED = "tenant:measured"  # the key whose runs are claimed
FULL = "tenant:full"  # a key with every slot in use: its claims are refused
NODE = "bench-node:1:1"
RATE_BIG = 100_000  # starts per hour of the rate-limited workflow: its windows never fill here
RATE_SMALL = 10  # ... of the one whose hot key is past its limit
HOUR = 3600.0
TRANSACTION = ("BEGIN", "COMMIT", "ROLLBACK")

# Every bulk-loaded run: {created} is a SQL timestamp of g (1..:n), the other {}s SQL values.
LOAD = """
INSERT INTO durable_runs (id, workflow, status, input, context, queue, step_index, fence,
                          created_at, started_at, finished_at, due_at, published,
                          locked_by, heartbeat_at, slot_key, rate_key, flow_wait)
SELECT {run_id}, CAST(:workflow AS text), CAST(:status AS text), jsonb_build_object('n', g),
       '{{}}'::jsonb, 'celery', 0, CASE WHEN CAST(:status AS text) = 'running' THEN 1 ELSE 0 END,
       {created},
       CASE WHEN CAST(:status AS text) IN ('running', 'completed') THEN {created} END,
       CASE WHEN CAST(:status AS text) = 'completed' THEN {created} END,
       CASE WHEN CAST(:status AS text) = 'pending' AND CAST(:flow_wait AS text) IS NULL THEN now() END,
       CAST(:status AS text) = 'pending' AND CAST(:flow_wait AS text) IS NULL,
       CASE WHEN CAST(:status AS text) = 'running' THEN CAST(:node AS text) END,
       CASE WHEN CAST(:status AS text) = 'running' THEN now() END,
       {slot_key}, {rate_key}, CAST(:flow_wait AS text)
FROM generate_series(1, :n) AS g
"""
FINISH = (
    "UPDATE durable_runs SET status = 'completed', finished_at = now(), locked_by = NULL,"
    " heartbeat_at = NULL WHERE id = :id"
)

# Timed runs are started before everything parked (a woken run is the oldest of its line); the
# runs holding slots before them; refused ones after everything.
TIMED = "now() - interval '1 day' + make_interval(secs => g / 1000.0)"
HOLDING = "now() - interval '2 days' + make_interval(secs => g / 1000.0)"
PARKED = "now() - interval '1 hour' + make_interval(secs => g / 1000.0)"
LATE = "now() + make_interval(secs => g / 1000.0)"
IN_WINDOW = "now() - interval '50 minutes' + make_interval(secs => g / 1000.0)"
BEFORE_WINDOW = "now() - interval '2 hours' + make_interval(secs => g / 1000.0)"


def load(
    durable: Durable,
    n: int,
    workflow: str,
    status: str,
    created: str,
    slot_key: str = "NULL",
    rate_key: str = "NULL",
    flow_wait: str | None = None,
) -> list[str]:
    """Bulk-insert ``n`` runs (``created``, ``slot_key`` and ``rate_key`` are SQL expressions of
    ``g``); returns the ids of the pending, due ones, oldest first (the runs to claim)."""
    sql = LOAD.format(run_id=run_id_sql(created), created=created, slot_key=slot_key, rate_key=rate_key)
    params = {"workflow": workflow, "status": status, "flow_wait": flow_wait, "node": NODE, "n": n}
    with durable.db.begin() as conn:
        conn.execute(text(sql), params)
        if status != "pending" or flow_wait is not None:
            return []
        rows = conn.execute(
            text(
                "SELECT id FROM durable_runs WHERE workflow = :workflow AND status = 'pending'"
                " AND flow_wait IS NULL AND due_at IS NOT NULL AND coalesce(slot_key, '') = :key"
                " ORDER BY created_at, id"
            ),
            {"workflow": workflow, "key": slot_key[1:-1] if slot_key.startswith("'") else ""},
        )
        return [r.id for r in rows]


def make(url: str, outbox: RecordingOutbox | None = None) -> Durable:
    """A Durable on ``url`` with the bench's workflows (no upkeep, a small pool)."""
    app = Celery("bench_flow", broker="memory://")
    durable = Durable(app, url, upkeep=False, pool_size=2, outbox=outbox)
    durable.workflow("plain").step(lambda **data: None, name="first")
    limits: dict[str, dict[str, Any]] = {
        "limited": {"concurrency": {"limit": SLOT_LIMIT, "key": "tenant:{tenant}"}},
        "rated": {"rate_limit": {"limit": RATE_BIG, "period": HOUR, "key": "user:{user}"}},
        "rated_small": {"rate_limit": {"limit": RATE_SMALL, "period": HOUR, "key": "user:{user}"}},
    }
    for name, options in limits.items():
        durable.workflow(name, **options).step(lambda **data: None, name="first")
    return durable


class Probe:
    """Times the calls of one case; with ``count``, also records the statements each sends."""

    def __init__(self, durable: Durable, count: bool = False) -> None:
        self.durable, self.count = durable, count
        self.took: list[float] = []
        self.calls: list[list[str]] = []

    @contextmanager
    def __call__(self) -> Iterator[None]:
        """Around one measured call."""
        seen: list[str] = []
        engine = self.durable.db.engine
        listeners: list[tuple[str, Callable[..., None]]] = [
            ("before_cursor_execute", lambda conn, cursor, sql, *args: seen.append(_label(sql))),
            ("begin", lambda conn: _sent(conn, seen, "BEGIN")),
            ("commit", lambda conn: _sent(conn, seen, "COMMIT")),
            ("rollback", lambda conn: _sent(conn, seen, "ROLLBACK")),
        ]
        if self.count:
            for name, listener in listeners:
                event.listen(engine, name, listener)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.took.append((time.perf_counter() - t0) * 1000)
            if self.count:
                for name, listener in listeners:
                    event.remove(engine, name, listener)
                self.calls.append(seen)


def _sent(conn: Any, seen: list[str], what: str) -> None:
    """A BEGIN, COMMIT or ROLLBACK psycopg sends: none on a connection in autocommit, and no
    ROLLBACK outside a transaction (SQLAlchemy reports one as a connection goes back to the pool)."""
    if getattr(conn.connection.dbapi_connection, "autocommit", False):
        return
    ends = sum(s in ("COMMIT", "ROLLBACK") for s in seen)
    if what == "ROLLBACK" and seen.count("BEGIN") <= ends:
        return
    seen.append(what)


def _label(sql: str) -> str:
    """A statement by what it does: lock, count, or its verb and table."""
    flat = " ".join(sql.split())
    if "pg_advisory_xact_lock" in flat:
        return "lock"
    if flat.upper().startswith("SELECT COUNT"):
        return "count"
    verb = flat.split(" ", 1)[0].upper()
    for table in ("durable_activity", "durable_keys", "durable_runs"):
        if table in flat:
            return f"{verb} {table.removeprefix('durable_')}"
    return verb


def claim_plain(durable: Durable, n: int, probe: Probe) -> None:
    """Claim ``n`` new runs of the plain workflow one at a time (``queries.claim_run``)."""
    ids = load(durable, n, "plain", "pending", TIMED)
    db = durable.db
    with db.single() as conn:
        for run_id in ids:
            with probe():
                row = queries.claim_run(db, conn, run_id, 0, NODE, None)
            assert row is not None, run_id
            conn.execute(text(FINISH), {"id": run_id})


def claim_limited(durable: Durable, n: int, probe: Probe) -> None:
    """Claim ``n`` new runs of the measured key with ``flow.claim``; each gets the free slot."""
    wf = durable.registry.workflows["limited"]
    ids = load(durable, n, "limited", "pending", TIMED, slot_key=f"'{MEASURED}'")
    for run_id in ids:
        with probe():
            row = flow.claim(durable.runtime, wf, wf.steps[0], run_id, NODE, False)
        assert row is not None, f"{run_id} got no slot"
        with durable.db.single() as conn:  # the step ended: its slot is free again
            conn.execute(text(FINISH), {"id": run_id})


def refused(key: str) -> Callable[[Durable, int, Probe], None]:
    """Claims of new runs of ``key`` that find no slot free: each is parked."""

    def claim(durable: Durable, n: int, probe: Probe) -> None:
        wf = durable.registry.workflows["limited"]
        ids = load(durable, n, "limited", "pending", LATE, slot_key=f"'{key}'")
        for run_id in ids:
            with probe():
                row = flow.claim(durable.runtime, wf, wf.steps[0], run_id, NODE, False)
            assert row is None, f"{run_id} got a slot"
        with durable.db.engine.connect() as conn:
            parked = conn.execute(
                text("SELECT count(*) FROM durable_runs WHERE id = ANY(:ids) AND flow_wait = 'slot'"),
                {"ids": ids},
            ).scalar_one()
        assert parked == len(ids), f"{parked} of {len(ids)} refused claims parked"

    return claim


def starts(workflow: str, user: Callable[[], str]) -> Callable[[Durable, int, Probe], None]:
    """``n`` starts of ``workflow`` with input ``{"user": user()}``."""

    def start(durable: Durable, n: int, probe: Probe) -> None:
        for _ in range(n):
            data = {"user": user()}
            with probe():
                durable.start(workflow, data)

    return start


def start_refused(durable: Durable, n: int, probe: Probe) -> None:
    """``n`` starts on the full key of the small rate limit: each raises RateLimited."""
    for _ in range(n):
        with probe(), suppress(RateLimited):
            durable.start("rated_small", {"user": "hot"})
            raise AssertionError("a start past the rate limit was accepted")


Case = tuple[Durable, Callable[[Durable, int, Probe], None]]


def prepare(
    empty: Durable, full: Durable, rate: Durable, parked: int, other_keys: int, running: int, timer: Timer
) -> None:
    """Load the three databases (progress as it goes), then VACUUM ANALYZE them."""
    for durable in (empty, full):
        load(durable, RUNNING, "limited", "running", HOLDING, slot_key=f"'{MEASURED}'")
        load(durable, SLOT_LIMIT, "limited", "running", HOLDING, slot_key=f"'{FULL}'")
        load(durable, running, "limited", "running", HOLDING, slot_key="'tenant:busy' || g")
    say(
        f"{timer} loaded {RUNNING} running steps of {MEASURED!r}, {SLOT_LIMIT} of {FULL!r} and {running}"
        " of other keys (both databases)"
    )
    for key in (MEASURED, FULL):
        load(full, parked, "limited", "pending", PARKED, slot_key=f"'{key}'", flow_wait="slot")
        say(f"{timer} parked {parked:,} runs for a slot of {key!r} (one INSERT ... SELECT generate_series)")
    others = f"'tenant:other' || (g % {other_keys})"
    load(full, parked, "limited", "pending", PARKED, slot_key=others, flow_wait="slot")
    say(f"{timer} parked {parked:,} runs on {other_keys:,} other keys")
    # The same runs, finished, where none waits: both tables (and their statistics, which the
    # planner reads for every statement) are the same size, only waiting differs.
    for key in (f"'{MEASURED}'", f"'{FULL}'", others):
        load(empty, parked, "limited", "completed", PARKED, slot_key=key)
    say(f"{timer} loaded as many finished runs of the same keys where none waits")
    for workflow in ("rated", "rated_small"):
        load(rate, parked, workflow, "completed", IN_WINDOW, rate_key="'user:hot'")
    say(f"{timer} loaded {parked:,} starts of 'user:hot' in the last hour, for each rate-limited workflow")
    load(rate, parked, "rated", "completed", BEFORE_WINDOW, rate_key="'user:old' || g")
    say(f"{timer} loaded {parked:,} starts of other keys before the window")
    for durable in (empty, full, rate):
        with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE"))
            # No autovacuum pass in the middle of a round: it would slow one case only.
            conn.execute(text("ALTER TABLE durable_runs SET (autovacuum_enabled = false)"))
    say(f"{timer} loaded and vacuumed")


@click.command()
@click.option(
    "--parked",
    default=10_000,
    show_default=True,
    type=click.IntRange(1),
    help="Runs parked for a slot of the measured key (as many on other keys); starts in a rate window.",
)
@click.option(
    "--other-keys",
    default=1000,
    show_default=True,
    type=click.IntRange(1),
    help="Keys of the other parked runs.",
)
@click.option(
    "--running",
    default=100,
    show_default=True,
    type=click.IntRange(0),
    help="Steps executing on other keys, in both claim databases.",
)
@click.option(
    "--claims", default=2000, show_default=True, type=click.IntRange(10), help="Claims timed per case."
)
@click.option(
    "--starts",
    "start_count",
    default=1000,
    show_default=True,
    type=click.IntRange(10),
    help="Starts timed per case.",
)
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(1), help="Alternating rounds.")
@click.option(
    "--count", default=20, show_default=True, type=click.IntRange(1), help="Calls per case counted."
)
@click.option("--server", default=SERVER, show_default=True, help="PostgreSQL server (databases made there).")
def main(
    parked: int,
    other_keys: int,
    running: int,
    claims: int,
    start_count: int,
    rounds: int,
    count: int,
    server: str,
) -> None:
    """What flow control costs a claim and a start (prints figures, not a test)."""
    timer = Timer()
    with (
        scratch_database(server, "bench_ops_flow_empty") as empty_url,
        scratch_database(server, "bench_ops_flow_parked") as parked_url,
        scratch_database(server, "bench_ops_flow_rate") as rate_url,
    ):
        empty, full, rate = make(empty_url), make(parked_url), make(rate_url, RecordingOutbox())
        prepare(empty, full, rate, parked, other_keys, running, timer)
        new_keys = itertools.count()
        claim_cases: dict[str, Case] = {
            "(a) plain": (empty, claim_plain),
            "(b) limited, none waiting": (empty, claim_limited),
            f"(c) limited, {parked:,} parked": (full, claim_limited),
            f"(d) plain, {3 * parked:,} parked": (full, claim_plain),
            "refused claim, key full": (empty, refused(FULL)),
            f"refused claim, {parked:,} ahead": (full, refused(FULL)),
        }
        start_cases: dict[str, Case] = {
            "start, no limit": (rate, starts("plain", lambda: "u")),
            "start, rate_limit, new key": (rate, starts("rated", lambda: f"new{next(new_keys)}")),
            f"start, rate_limit, {parked:,} in window": (rate, starts("rated", lambda: "hot")),
            "start refused (RateLimited)": (rate, start_refused),
        }
        cases = {**claim_cases, **start_cases}
        probes = {name: Probe(durable) for name, (durable, _) in cases.items()}
        for round_no in range(1, rounds + 1):
            for name, (durable, call) in cases.items():
                call(
                    durable, max(1, (claims if name in claim_cases else start_count) // rounds), probes[name]
                )
            say(
                f"{timer} round {round_no}/{rounds}, median ms: "
                + ", ".join(f"{n.split(',')[0]} {statistics.median(p.took):.3f}" for n, p in probes.items())
            )
        say(f"{timer} counting statements ({count} untimed calls per case)")
        counted = {name: Probe(durable, count=True) for name, (durable, _) in cases.items()}
        for name, (durable, call) in cases.items():
            call(durable, count, counted[name])
        report(probes, counted)
        for durable in (empty, full, rate):
            durable.db.dispose()


def report(probes: dict[str, Probe], counted: dict[str, Probe]) -> None:
    """Print the figures and the verdicts."""
    say("")
    say(
        f"{'case':36}  {'calls':>5}  {'median ms':>9}  {'p95 ms':>7}  {'statements':>10}  {'round trips':>11}"
    )
    medians = {}
    for name, probe in probes.items():
        medians[name] = statistics.median(probe.took)
        p95 = statistics.quantiles(probe.took, n=20)[-1]
        calls = counted[name].calls
        statements = statistics.mean(sum(s not in TRANSACTION for s in call) for call in calls)
        trips = statistics.mean(len(call) for call in calls)
        say(
            f"{name:36}  {len(probe.took):>5}  {medians[name]:>9.3f}  {p95:>7.3f}  {statements:>10.1f}"
            f"  {trips:>11.1f}"
        )
    say("")
    say("one call of each (psycopg sends no BEGIN or COMMIT for a statement in autocommit):")
    for name, probe in counted.items():
        say(f"  {name}: {' -> '.join(probe.calls[-1]) or '(autocommit)'}")
    say("")
    a, b, c, d, _, _, plain, new, hot, _ = list(probes)
    for top, bottom in ((c, b), (d, a)):
        ratio = medians[top] / medians[bottom]
        verdict = "met" if ratio <= RATIO_TARGET else "NOT met"
        say(f"median ratio {top} / {bottom}: {ratio:.2f}  target <= {RATIO_TARGET}: {verdict}")
    # A rate limit's count reads the key's starts in its window up to the limit: with a limit of
    # RATE_BIG it grows with the starts in the window (no target; limits are usually small).
    for top, bottom in ((b, a), (new, plain), (hot, new), (hot, plain)):
        say(f"for scale: {top} / {bottom}: {medians[top] / medians[bottom]:.2f}")


if __name__ == "__main__":
    main()
