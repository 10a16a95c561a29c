"""What waiting for answers costs (issue 41): the statements while callers wait, and how soon
a caller hears that its run has ended.

    python -m bench.answers                          # about a minute
    python -m bench.answers --waiters 1,100 --window 2 --runs 100
    python -m bench.answers --help

1. **Waiting.** For 1 and 1,000 callers (``--waiters``), as threads calling ``durable.result``
   and as tasks on one event loop awaiting ``durable.aresult``, each waiting for a run of its
   own that never ends by itself (started with a ``RecordingOutbox``: no worker, no message).
   Once every caller waits (``durable.answers.waiting()``), every statement on durable's engine
   is counted for ``--window`` seconds (SQLAlchemy's ``before_cursor_execute``), by the thread
   that issued it (the answers thread, ``durable-answers``, or another), with each look's time
   and the process's CPU. Then the runs are all cancelled in one ``UPDATE`` from another
   connection, and each caller's ``RunCancelled`` is timed from that commit: 1,000 runs ending
   at once. ``upkeep`` is off, so nothing else of durable's issues statements.
2. **Hearing.** ``--runs`` runs of a one-step workflow, worked by a real Celery worker in this
   process (threads pool, ``--concurrency``) on a Redis of the bench's own, started and waited
   for by ``--callers`` threads (``start`` then ``result``), then by as many tasks on one event
   loop (``astart`` then ``aresult``); the step sleeps 0 to 100 ms (drawn per run, so that runs
   end at any moment of the answers thread's 50 ms between looks) and returns ``time.time()``
   just before it returns. The figure is the time from that moment to ``result`` returning (so
   it includes the worker recording the run's end), and, beside it, from the run's
   ``finished_at``. Durable's settings are the defaults. Targets: p50 <= 100 ms, p99 <= 500 ms.

A scratch database (``bench_ops_answers_*``) and a redis-server of its own are used and removed
at the end. This prints figures; it is not a test.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click
from celery import Celery
from sqlalchemy import create_engine, event, select, update

from bench.common import private_redis, say
from bench.scratch import SERVER, Timer, scratch_database
from durable_celery import Durable, RunCancelled
from durable_celery.core.answers import POLL
from durable_celery.store.schema import runs
from durable_celery.testing import RecordingOutbox, worker

WORKFLOW = "answers"
ANSWERS_THREAD = "durable-answers"
P50_TARGET, P99_TARGET = 0.100, 0.500
MODES = ("threads", "asyncio")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


# -- 1. waiting -------------------------------------------------------------------------------


class StatementCounter:
    """Statements on an engine, by issuing thread, and how long the answers thread's took."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.by_thread: Counter[str] = Counter()
        self.look_seconds: list[float] = []
        self._began = threading.local()
        self._lock = threading.Lock()
        event.listen(engine, "before_cursor_execute", self._before)
        event.listen(engine, "after_cursor_execute", self._after)

    def _before(self, *_: Any) -> None:
        name = threading.current_thread().name
        who = "answers" if name == ANSWERS_THREAD else "others"
        with self._lock:
            self.by_thread[who] += 1
        self._began.at = time.perf_counter()

    def _after(self, *_: Any) -> None:
        if threading.current_thread().name == ANSWERS_THREAD:
            took = time.perf_counter() - self._began.at
            with self._lock:
                self.look_seconds.append(took)

    def reset(self) -> None:
        with self._lock:
            self.by_thread.clear()
            self.look_seconds.clear()

    def close(self) -> None:
        event.remove(self.engine, "before_cursor_execute", self._before)
        event.remove(self.engine, "after_cursor_execute", self._after)


@dataclass
class WaitingFigures:
    """What one case of waiting measured."""

    mode: str
    waiters: int
    window: float
    statements: Counter[str]
    look_seconds: list[float]
    cpu: float  # seconds of CPU the process used in the window
    released: list[float] = field(default_factory=list)  # seconds from the cancel to each caller

    def per_second(self, who: str | None = None) -> float:
        count = sum(self.statements.values()) if who is None else self.statements[who]
        return count / self.window


def wait_threads(durable: Durable, run_ids: list[str], heard: list[float]) -> Callable[[], None]:
    """Start one thread per run calling ``result``; returns what joins them."""

    def wait(run_id: str) -> None:
        try:
            durable.result(run_id, timeout=600)
        except RunCancelled:
            heard.append(time.time())

    threads = [threading.Thread(target=wait, args=(run_id,), daemon=True) for run_id in run_ids]
    for thread in threads:
        thread.start()

    def join() -> None:
        for thread in threads:
            thread.join(120)

    return join


def wait_tasks(durable: Durable, run_ids: list[str], heard: list[float]) -> Callable[[], None]:
    """Start one event loop (in a thread) with a task per run awaiting ``aresult``."""

    async def wait(run_id: str) -> None:
        try:
            await durable.aresult(run_id, timeout=600)
        except RunCancelled:
            heard.append(time.time())

    async def main() -> None:
        await asyncio.gather(*(wait(run_id) for run_id in run_ids))

    loop_thread = threading.Thread(target=asyncio.run, args=(main(),), name="bench-loop", daemon=True)
    loop_thread.start()
    return lambda: loop_thread.join(120)


def cancel_all(url: str, run_ids: list[str]) -> float:
    """Cancel the runs in one UPDATE on a connection of its own; the time of its commit."""
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn:
            conn.execute(
                update(runs)
                .where(runs.c.id.in_(run_ids))
                .values(status="cancelled", finished_at=runs.c.created_at, due_at=None)
            )
        return time.time()
    finally:
        engine.dispose()


def waiting_case(durable: Durable, url: str, mode: str, waiters: int, window: float) -> WaitingFigures:
    """Callers wait for runs that do not end; count the statements of a window, then end them."""
    run_ids = [durable.start(WORKFLOW, {"seconds": 0}) for _ in range(waiters)]
    heard: list[float] = []
    counter = StatementCounter(durable.db.engine)
    try:
        join = (wait_threads if mode == "threads" else wait_tasks)(durable, run_ids, heard)
        deadline = time.monotonic() + 120
        while durable.answers.waiting() < waiters:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {durable.answers.waiting()} of {waiters} callers wait after 120 s")
            time.sleep(0.02)
        counter.reset()
        cpu = time.process_time()
        time.sleep(window)
        cpu = time.process_time() - cpu
        figures = WaitingFigures(
            mode, waiters, window, Counter(counter.by_thread), list(counter.look_seconds), cpu
        )
    finally:
        counter.close()
    cancelled_at = cancel_all(url, run_ids)
    join()
    figures.released = [at - cancelled_at for at in heard]
    return figures


def measure_waiting(url: str, counts: list[int], window: float, timer: Timer) -> list[WaitingFigures]:
    app = Celery("bench_answers_waiting", broker="memory://", set_as_current=False)
    durable = Durable(app, url, upkeep=False, outbox=RecordingOutbox())
    durable.workflow(WORKFLOW).step(lambda seconds: None, name="never_sent")
    done: list[WaitingFigures] = []
    try:
        for mode in MODES:
            for waiters in counts:
                figures = waiting_case(durable, url, mode, waiters, window)
                done.append(figures)
                say(
                    f"{timer} waiting, {mode}, {waiters} callers: {figures.per_second():.1f} statements/s "
                    f"({figures.per_second('answers'):.1f}/s by the answers thread), "
                    f"all answered {max(figures.released, default=float('nan')) * 1000:.0f} ms "
                    "after their runs were cancelled"
                )
    finally:
        durable.db.dispose()
    return done


# -- 2. hearing -------------------------------------------------------------------------------


@dataclass
class Heard:
    """One run's answer: when its step returned, when ``result`` returned."""

    run_id: str
    step_returned: float
    result_returned: float
    finished_at: float = float("nan")

    @property
    def after_step(self) -> float:
        return self.result_returned - self.step_returned

    @property
    def after_finished_at(self) -> float:
        return self.result_returned - self.finished_at


def define_timed(durable: Durable) -> None:
    wf = durable.workflow(WORKFLOW)

    @wf.step
    def work(seconds: float) -> float:
        time.sleep(seconds)
        return time.time()  # the last thing the step does


def hear_threads(durable: Durable, runs_wanted: int, callers: int) -> list[Heard]:
    heard: list[Heard] = []
    slots = iter(range(runs_wanted))  # each caller takes the next run to make; next() holds the GIL

    def caller() -> None:
        for _ in slots:
            run_id = durable.start(WORKFLOW, {"seconds": random.uniform(0, 0.1)})
            step_returned = durable.result(run_id, timeout=60)
            heard.append(Heard(run_id, step_returned, time.time()))

    threads = [threading.Thread(target=caller) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return heard


def hear_tasks(durable: Durable, runs_wanted: int, callers: int) -> list[Heard]:
    heard: list[Heard] = []
    slots = iter(range(runs_wanted))

    async def caller() -> None:
        for _ in slots:
            run_id = await durable.astart(WORKFLOW, {"seconds": random.uniform(0, 0.1)})
            step_returned = await durable.aresult(run_id, timeout=60)
            heard.append(Heard(run_id, step_returned, time.time()))

    async def main() -> None:
        await asyncio.gather(*(caller() for _ in range(callers)))

    asyncio.run(main())
    return heard


def add_finished_at(durable: Durable, heard: list[Heard]) -> None:
    with durable.db.engine.connect() as conn:
        rows = conn.execute(
            select(runs.c.id, runs.c.finished_at).where(runs.c.id.in_([h.run_id for h in heard]))
        )
        finished = {row.id: row.finished_at.timestamp() for row in rows}
    for one in heard:
        one.finished_at = finished[one.run_id]


def measure_hearing(
    url: str, broker: str, runs_wanted: int, callers: int, concurrency: int, timer: Timer
) -> dict[str, list[Heard]]:
    queue = f"answers-{uuid.uuid4().hex[:6]}"
    app = Celery("bench_answers_hearing", broker=broker, set_as_current=False)
    app.conf.update(task_default_queue=queue, broker_connection_retry_on_startup=True)
    durable = Durable(app, url)  # the default settings
    define_timed(durable)
    found: dict[str, list[Heard]] = {}
    try:
        with worker(durable, concurrency=concurrency, queues=[queue]):
            hear_threads(durable, 10, 2)  # warm up: connections, the first messages
            say(f"{timer} hearing: worker up, warmed up")
            for mode in MODES:
                hear = hear_threads if mode == "threads" else hear_tasks
                found[mode] = hear(durable, runs_wanted, callers)
                add_finished_at(durable, found[mode])
                after = [h.after_step for h in found[mode]]
                say(
                    f"{timer} hearing, {mode}: {len(after)} runs, p50 {quantile(after, 0.5) * 1000:.1f} ms, "
                    f"p99 {quantile(after, 0.99) * 1000:.1f} ms after the step returned"
                )
        durable.flush(10)
    finally:
        durable.db.dispose()
    return found


# -- the report -------------------------------------------------------------------------------


def report_waiting(figures: list[WaitingFigures], window: float) -> None:
    say(f"waiting: statements by this process while callers wait ({window:g} s window; POLL {POLL:g} s)")
    heads = (
        "mode",
        "callers",
        "stmts/s",
        "answers/s",
        "others/s",
        "look p50",
        "look max",
        "CPU",
        "all freed",
    )
    say(f"  {heads[0]:<8}" + "".join(f"{h:>11}" for h in heads[1:]))
    for f in figures:
        say(
            f"  {f.mode:<8}{f.waiters:>11}{f.per_second():>11.1f}{f.per_second('answers'):>11.1f}"
            f"{f.per_second('others'):>11.1f}{quantile(f.look_seconds, 0.5) * 1000:>9.2f}ms"
            f"{max(f.look_seconds, default=float('nan')) * 1000:>9.2f}ms{f.cpu / f.window * 100:>10.1f}%"
            f"{max(f.released, default=float('nan')) * 1000:>9.0f}ms"
        )
    say(
        f"  (one look per {POLL:g} s is {1 / POLL:.0f}/s, and every 20th look a second statement for "
        "pruned runs: 21/s; CPU: the whole process, % of one core; all freed: from the commit "
        "cancelling every run to the last caller's RunCancelled)"
    )
    for mode in MODES:
        rates = {f.waiters: f.per_second() for f in figures if f.mode == mode}
        if len(rates) > 1:
            low, high = rates[min(rates)], rates[max(rates)]
            say(
                f"  {mode}: {max(rates)} callers issue {high / low:.2f} x the statements of {min(rates)}"
                f" (one statement per look, however many wait: {met(high / low <= 1.1)})"
            )


def report_hearing(found: dict[str, list[Heard]], callers: int, concurrency: int) -> None:
    say("")
    say(
        f"hearing: a run's end to result() returning; {callers} callers, worker of {concurrency} threads,"
        " default settings"
    )
    say(f"  {'mode':<8}{'runs':>6}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}   from finished_at: p50, p99")
    for mode, heard in found.items():
        after = [h.after_step for h in heard]
        since = [h.after_finished_at for h in heard]
        cells = "".join(f"{quantile(after, q) * 1000:>8.1f}ms" for q in (0.5, 0.9, 0.99, 1.0))
        say(
            f"  {mode:<8}{len(heard):>6}{cells}   {quantile(since, 0.5) * 1000:.1f} ms, "
            f"{quantile(since, 0.99) * 1000:.1f} ms"
        )
    every = [h.after_step for heard in found.values() for h in heard]
    for name, q, target in (("p50", 0.5, P50_TARGET), ("p99", 0.99, P99_TARGET)):
        value = quantile(every, q)
        say(
            f"  target {name} <= {target * 1000:.0f} ms: {met(value <= target)}"
            f" ({value * 1000:.1f} ms, every run)"
        )


@click.command()
@click.option(
    "--waiters", default="1,1000", show_default=True, help="Callers waiting at once, comma-separated."
)
@click.option("--window", default=5.0, show_default=True, help="Seconds the statements are counted for.")
@click.option("--runs", default=300, show_default=True, help="Runs timed per mode (threads, asyncio).")
@click.option("--callers", default=8, show_default=True, help="Threads (or tasks) starting and waiting.")
@click.option("--concurrency", default=4, show_default=True, help="Threads of the in-process worker.")
@click.option("--server", default=SERVER, show_default=True, help="PostgreSQL server (database made there).")
@click.option("--broker", default="", help="Redis URL; default: a redis-server of the bench's own.")
def main(
    waiters: str, window: float, runs: int, callers: int, concurrency: int, server: str, broker: str
) -> None:
    """Statements while 1 and 1,000 callers wait, and a run's end to result() (prints figures)."""
    timer = Timer()
    counts = [int(n) for n in waiters.split(",") if n.strip()]
    with private_redis(broker) as broker_url, scratch_database(server, "bench_ops_answers") as url:
        waiting = measure_waiting(url, counts, window, timer)
        found = measure_hearing(url, broker_url, runs, callers, concurrency, timer)
    say("")
    report_waiting(waiting, window)
    report_hearing(found, callers, concurrency)


if __name__ == "__main__":
    main()
