"""Answers for callers (issue 41): ``result`` and ``execute`` wait for a run's end and give its
output, or say how it ended; the async twins keep the event loop free. Real PostgreSQL, Redis
and a Celery worker in the process."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from sqlalchemy import delete, event

from durable_celery import (
    DurableError,
    InvalidArgument,
    ResultTimeout,
    RunCancelled,
    RunFailed,
    RunNotFound,
    current_run,
)
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=["postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _define(durable: Any) -> None:
    pay = durable.workflow("pay", key="pay:{order}")

    @pay.step(retry=2, backoff=0.1)
    def charge(order: int, amount: int) -> dict[str, int]:
        if amount < 0:
            raise ValueError(f"a negative amount: {amount}")
        if amount == 0:
            current_run().wait_for_event("go")
        return {"order": order, "charged": amount}


def test_result_and_execute_give_the_output_of_a_completed_run(durable: Any) -> None:
    _define(durable)
    with worker(durable):
        run_id = durable.start("pay", {"order": 1, "amount": 5})
        assert durable.result(run_id, timeout=30) == {"order": 1, "charged": 5}
        assert durable.execute("pay", {"order": 2, "amount": 7}, timeout=30) == {"order": 2, "charged": 7}


def test_a_failed_run_raises_run_failed_with_its_error(durable: Any) -> None:
    _define(durable)
    with worker(durable):
        run_id = durable.start("pay", {"order": 3, "amount": -1})
        with pytest.raises(RunFailed) as failed:
            durable.result(run_id, timeout=30)
    assert failed.value.run_id == run_id and failed.value.status == "failed"
    assert failed.value.error_type == "ValueError" and "a negative amount: -1" in failed.value.error_message


def test_a_cancelled_run_raises_run_cancelled_and_a_timeout_leaves_the_run_going(durable: Any) -> None:
    _define(durable)
    with worker(durable):
        run_id = durable.start("pay", {"order": 4, "amount": 0})  # waits for an event
        with pytest.raises(ResultTimeout) as late:
            durable.result(run_id, timeout=0.5)
        assert isinstance(late.value, TimeoutError) and isinstance(late.value, DurableError)
        assert durable.get_run(run_id).status in ("pending", "running", "waiting")
        threading.Timer(0.3, durable.cancel, (run_id,)).start()
        with pytest.raises(RunCancelled) as cancelled:
            durable.result(run_id, timeout=30)
    assert cancelled.value.run_id == run_id


def test_a_held_key_answers_execute_with_the_holders_output(durable: Any) -> None:
    _define(durable)
    with worker(durable):
        holder = durable.start("pay", {"order": 5, "amount": 0})
        got: list[Any] = []
        waiter = threading.Thread(
            target=lambda: got.append(durable.execute("pay", {"order": 5, "amount": 9}, timeout=30))
        )
        waiter.start()
        time.sleep(0.3)
        assert got == []  # the repeat waits for the holder, which waits for its event
        durable.send_event(holder, "go", buffer=True)
        waiter.join(30)
    assert got == [{"order": 5, "charged": 0}]


def test_unknown_and_pruned_runs_raise_run_not_found_not_a_hang(durable: Any) -> None:
    _define(durable)
    with pytest.raises(RunNotFound):
        durable.result("no-such-run", timeout=1)
    run_id = durable.start("pay", {"order": 6, "amount": 0})  # no worker: it stays pending

    def prune() -> None:
        with durable.db.begin() as conn:
            conn.execute(delete(runs).where(runs.c.id == run_id))

    threading.Timer(0.2, prune).start()
    with pytest.raises(RunNotFound):
        durable.result(run_id, timeout=30)


def test_waiting_inside_a_step_is_refused(durable: Any) -> None:
    _define(durable)
    waits = durable.workflow("waits")
    said: list[str] = []

    @waits.step
    def inner() -> None:
        with pytest.raises(InvalidArgument) as refused:
            durable.execute("pay", {"order": 7, "amount": 1})
        said.append(str(refused.value))

    durable.run_message("waits", 0, durable.start(waits))
    assert "call_workflow" in said[0] and durable.list_runs(workflow="pay") == []


def test_a_thousand_waiters_cost_one_statement_per_look(durable: Any) -> None:
    """Every run waited on in the process is looked at in one statement per poll."""
    _define(durable)
    ids = [durable.start("pay", {"order": 1000 + n, "amount": 0}) for n in range(1000)]
    looks: list[float] = []

    def count(*_: Any) -> None:
        if threading.current_thread().name == "durable-answers":
            looks.append(time.monotonic())

    event.listen(durable.db.engine, "before_cursor_execute", count)
    try:
        waiters = [threading.Thread(target=_wait_briefly, args=(durable, run_id)) for run_id in ids]
        for thread in waiters:
            thread.start()
        for thread in waiters:
            thread.join(60)
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", count)
    span = max(looks) - min(looks)
    assert len(looks) <= span / durable.answers.poll * 1.2 + 5, (len(looks), span)
    assert durable.answers.waiting() == 0


def _wait_briefly(durable: Any, run_id: str) -> None:
    with pytest.raises(ResultTimeout):
        durable.result(run_id, timeout=1.0)


def test_the_async_twins_keep_the_event_loop_free(durable: Any) -> None:
    _define(durable)

    async def main() -> tuple[Any, Any, int, bool, str]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.create_task(tick())
        run_id = await durable.astart("pay", {"order": 8, "amount": 0})
        waiting = asyncio.create_task(durable.aresult(run_id, timeout=30))
        ticks = 0
        for _ in range(30):  # 30 turns of this coroutine while aresult waits
            await asyncio.sleep(0.01)
        pending = not waiting.done()
        before = ticks
        await asyncio.to_thread(durable.send_event, run_id, "go", None, True)
        out = await waiting
        run = await durable.aget_run(run_id)
        other = await durable.aexecute("pay", {"order": 9, "amount": 3}, timeout=30)
        ticking.cancel()
        return out, other, before, pending, run.status

    with worker(durable):
        out, other, ticks, pending, status = asyncio.run(main())
    assert out == {"order": 8, "charged": 0} and status == "completed"
    assert other == {"order": 9, "charged": 3}
    # The loop ran on while aresult waited: another task kept pace with those 30 turns, however
    # slow the machine (a blocking wait would have held both until its timeout, then ended).
    assert pending and ticks >= 20


def test_astart_joins_an_async_session_or_connection_and_its_rollback(durable: Any, pg_url: str) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    _define(durable)
    engine = create_async_engine(pg_url.replace("postgresql://", "postgresql+psycopg_async://"))

    async def main() -> tuple[str, str, list[Any]]:
        async with AsyncSession(engine) as session, session.begin():
            in_session = await durable.astart("pay", {"order": 10, "amount": 2}, connection=session)
        async with engine.connect() as conn:
            await conn.begin()
            in_conn = await durable.astart("pay", {"order": 11, "amount": 3}, connection=conn)
            await conn.commit()
        async with engine.connect() as conn:
            await conn.begin()
            await durable.astart("pay", {"order": 12, "amount": 4}, connection=conn)
            await conn.rollback()  # the run and its key claim go with it
        await engine.dispose()
        return in_session, in_conn, await asyncio.to_thread(durable.list_runs, "pay", "pay:12")

    in_session, in_conn, rolled_back = asyncio.run(main())
    assert rolled_back == []
    with worker(durable):
        assert durable.result(in_session, timeout=30) == {"order": 10, "charged": 2}
        assert durable.result(in_conn, timeout=30) == {"order": 11, "charged": 3}


def test_a_fake_answers_once_run_until_idle_ran_the_run_and_eager_mode_at_once() -> None:
    from celery import Celery

    from durable_celery import Durable
    from durable_celery.testing import Fake

    fake = Fake()
    try:
        _define(fake)
        run_id = fake.start("pay", {"order": 1, "amount": 2})
        with pytest.raises(ResultTimeout):  # nothing runs its steps until the test says so
            fake.result(run_id, timeout=30)
        fake.run_until_idle()
        assert fake.result(run_id) == {"order": 1, "charged": 2}
        with fake.running():  # steps run in the background: result waits as on a worker
            assert fake.execute("pay", {"order": 2, "amount": 3}, timeout=30) == {"order": 2, "charged": 3}
    finally:
        fake.close()
    app = Celery("eager", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    eager = Durable(app, "memory://")
    try:
        _define(eager)
        assert eager.execute("pay", {"order": 3, "amount": 4}, timeout=5) == {"order": 3, "charged": 4}
    finally:
        eager.db.dispose()


def test_a_debounced_start_is_answered_by_the_run_that_finally_runs(durable: Any) -> None:
    wf = durable.workflow("bounce", key="b:{n}", debounce={"period": 0.3, "timeout": 5})
    wf.step(lambda n, v: v, name="echo")
    with worker(durable):
        first = durable.start(wf, {"n": 1, "v": 1})
        assert durable.start(wf, {"n": 1, "v": 2}) == first  # folded into the waiting run
        assert durable.result(first, timeout=30) == 2  # the newest input ran


@pytest.mark.parametrize("ending", ["compensated", "run_again"])
def test_every_ending_is_answered(durable: Any, ending: str) -> None:
    if ending == "compensated":
        wf = durable.workflow("undo")
        wf.step(lambda n: None, name="book", compensate=lambda n: None)

        @wf.step
        def ship(n: int) -> None:
            raise ValueError("out of stock")

        with worker(durable), pytest.raises(RunFailed) as failed:
            durable.execute(wf, {"n": 1}, timeout=30)
        assert failed.value.status == "compensated" and failed.value.error_type == "ValueError"
        return
    wf = durable.workflow("again", key="k:{n}", on_duplicate="run_again")

    @wf.step
    def echo(n: int, v: int) -> int:
        if v == 1:
            current_run().wait_for_event("go")
        return v

    first = durable.start(wf, {"n": 1, "v": 1})
    with worker(durable):
        wait_for(durable, first, statuses=("waiting",))  # claimed: a later start queues behind it
        again = durable.start(wf, {"n": 1, "v": 2})  # queued behind it, with the newest input
        assert again != first
        durable.send_event(first, "go", buffer=True)
        # A waiter on the old run gets the old run's output; the run behind it, its own.
        assert durable.result(first, timeout=30) == 1
        assert durable.result(again, timeout=30) == 2


def test_a_steps_progress_is_kept_on_its_run_and_shown(durable: Any) -> None:
    from starlette.testclient import TestClient

    from durable_celery.web import create_app
    from tests.integration.core.helpers import take_over_run

    report = durable.workflow("report")

    @report.step
    def build(pages: int) -> int:
        current_run().set_progress({"done": 3, "of": pages})
        with pytest.raises(InvalidArgument):
            current_run().set_progress({"not json": object()})
        with pytest.raises(InvalidArgument):
            current_run().set_progress("x" * 5000)
        if pages == 2:  # taken over: what it says now is not kept
            take_over_run(durable, current_run().id, "fenced")
            current_run().set_progress({"done": 99, "of": pages})
            return 0
        current_run().wait_for_event("go")
        return pages

    run_id = durable.start(report, {"pages": 10})
    assert durable.run_message("report", 0, run_id) == "waiting"
    assert durable.get_run(run_id).progress == {"done": 3, "of": 10}
    page = TestClient(create_app(durable)).get(f"/runs/{run_id}").text
    assert 'id="progress"' in page and "&#34;of&#34;: 10" in page.replace("&quot;", "&#34;")
    fenced = durable.start(report, {"pages": 2})
    assert durable.run_message("report", 0, fenced) == "fenced"
    assert durable.get_run(fenced).progress == {"done": 3, "of": 2}


def test_a_run_held_by_flow_control_is_answered_once_it_ran(durable: Any) -> None:
    wf = durable.workflow("limited", concurrency={"limit": 1, "key": "acct:{acct}"})
    inside, go = threading.Event(), threading.Event()

    @wf.step
    def work(acct: int, n: int) -> int:
        if n == 1:  # holds the key's one slot until the test lets it go
            inside.set()
            assert go.wait(30)
        return n

    with worker(durable, concurrency=2):
        first = durable.start(wf, {"acct": 1, "n": 1})
        assert inside.wait(30)
        second = durable.start(wf, {"acct": 1, "n": 2})  # parked until the first's slot frees
        with pytest.raises(ResultTimeout):
            durable.result(second, timeout=0.5)
        go.set()
        assert durable.result(second, timeout=30) == 2
        assert durable.result(first, timeout=30) == 1


def test_racing_starts_refused_by_a_key_say_whether_their_input_differs(durable: Any) -> None:
    """Idempotent requests: of starts racing with one key (``on_duplicate="error"``), one makes
    the run; every other is refused with ``KeyTaken`` naming it, its ``input_changed`` telling
    whether its input differs from the holder's (JSON equality: key order does not count)."""
    from durable_celery import KeyTaken

    wf = durable.workflow("charge", reuse="never")
    wf.step(lambda amount, currency: amount, name="charge")
    bodies = [
        {"amount": 5, "currency": "EUR"},
        {"currency": "EUR", "amount": 5},
        {"amount": 6, "currency": "EUR"},
    ]
    racers = 9
    gate = threading.Barrier(racers)
    said: list[tuple[int, Any]] = []

    def start(i: int) -> None:
        gate.wait()
        try:
            said.append((i, durable.start(wf, bodies[i % 3], key="idem-1", on_duplicate="error")))
        except KeyTaken as taken:
            said.append((i, taken))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    made = [(i, value) for i, value in said if isinstance(value, str)]
    assert len(said) == racers and len(made) == 1
    winner, run_id = made[0]
    assert [r.id for r in durable.list_runs()] == [run_id]
    holder_input = durable.get_run(run_id).input
    for i, value in said:
        if i != winner:
            assert value.holder_id == run_id and value.holder_status == "pending"
            assert value.input_changed is (bodies[i % 3] != holder_input), (i, bodies[i % 3], holder_input)
