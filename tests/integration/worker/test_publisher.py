"""The background publisher (publisher.py): a start's message leaves from a thread of the
producer's, promptly, looking as before; what it cannot send is flagged for the relay; a process
that exits, or forks, loses nothing and sends nothing twice. PostgreSQL, and Redis or RabbitMQ
(the tests of what the broker receives run on each of BROKERS)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
from celery import Celery
from celery.utils.nodenames import anon_nodename
from sqlalchemy import select

from durable_celery import Durable
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for, worker
from tests.conftest import BROKERS, DEAD_BROKERS, FAST, REDIS_URL
from tests.integration.helpers import delete_queue, message_run_id, take_messages

pytestmark = [pytest.mark.timeout(90)]
# No relay pass can be what sends a run here: it would wait this long for a lost message.
NO_RELAY = {**FAST, "relay_after": 600.0}


def make(url: str, broker: str, queue: str, **settings) -> Durable:
    app = Celery("publisher", broker=broker)
    app.conf.task_default_queue = queue
    app.conf.broker_connection_timeout = 1
    durable = Durable(app, url, **{**NO_RELAY, **settings})
    wf = durable.workflow("ship")

    @wf.step
    def pack(order):
        return f"packed {order}"

    return durable


def queue_name() -> str:
    return f"pub-{uuid.uuid4().hex[:8]}"


def claimed_within(durable: Durable, run_ids: list[str], seconds: float) -> float:
    """Poll until every run has been claimed (started_at set); the seconds that took."""
    began = time.monotonic()
    deadline = began + seconds
    while True:
        with durable.db.engine.connect() as conn:
            started = conn.execute(
                select(runs.c.id).where(runs.c.id.in_(run_ids), runs.c.started_at.is_not(None))
            ).all()
        if len(started) == len(run_ids):
            return time.monotonic() - began
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(run_ids) - len(started)} of {len(run_ids)} runs unclaimed after {seconds}s"
            )
        time.sleep(0.01)


def published_flags(durable: Durable, run_ids: list[str]) -> list[bool]:
    with durable.db.engine.connect() as conn:
        return list(conn.execute(select(runs.c.published).where(runs.c.id.in_(run_ids))).scalars())


@pytest.mark.parametrize("backend", BROKERS)
def test_a_start_is_claimed_promptly_with_no_relay_to_help(pg_url, broker_url):
    queue = queue_name()
    durable = make(pg_url, broker_url, queue)
    with worker(durable, queues=[queue]):
        lone = durable.start("ship", {"order": 1}, key="lone")
        assert claimed_within(durable, [lone], 5.0) < 5.0
        # A burst: the thread batches what queues up while it sends, and every one goes out.
        burst = [durable.start("ship", {"order": n}, key=f"burst-{n}") for n in range(200)]
        claimed_within(durable, burst, 20.0)
        assert all(wait_for(durable, run_id).status == "completed" for run_id in [lone, *burst])
    delete_queue(durable.app, queue)
    durable.db.dispose()


@pytest.mark.parametrize("backend", BROKERS)
def test_a_background_message_is_the_message_a_synchronous_publish_sends(pg_url, broker_url):
    queue = queue_name()
    background = make(pg_url, broker_url, queue)
    synchronous = make(pg_url, broker_url, queue, publish_in_background=False)
    first = background.start("ship", {"order": 1}, key="a")
    assert background.flush(timeout=10)
    second = synchronous.start("ship", {"order": 2}, key="b")
    messages = take_messages(background.app, queue)
    assert len(messages) == 2
    for message, run_id, key in zip(messages, (first, second), ("a", "b"), strict=True):
        headers = message.headers
        assert headers["task"] == "durable.ship.pack"
        assert headers["argsrepr"] == "()"
        assert headers["kwargsrepr"] == f"{{run_id: {run_id}, key: {key!r}, step: pack, attempt: 1}}"
        assert headers["ignore_result"] is True
        assert headers["origin"] == anon_nodename()  # gen<pid>@host, as Celery names a sender
        assert message.delivery_info["routing_key"] == queue
    shapes = [
        {k: v for k, v in m.headers.items() if k not in ("id", "root_id", "kwargsrepr")} for m in messages
    ]
    assert shapes[0] == shapes[1]
    delete_queue(background.app, queue)
    background.db.dispose()
    synchronous.db.dispose()


@pytest.mark.parametrize("backend", BROKERS)
def test_what_the_broker_refuses_is_flagged_for_the_relay_and_sent_when_it_is_back(
    pg_url, backend, broker_url
):
    queue = queue_name()
    producer = make(pg_url, DEAD_BROKERS[backend], queue, publish_retries=0)
    run_ids = [producer.start("ship", {"order": n}) for n in range(5)]
    assert producer.flush(timeout=20)
    assert published_flags(producer, run_ids) == [False] * 5  # the relay's to send
    consumer = make(pg_url, broker_url, queue)
    with worker(consumer, queues=[queue]):
        assert all(wait_for(consumer, run_id, timeout=20).status == "completed" for run_id in run_ids)
    delete_queue(consumer.app, queue)
    producer.db.dispose()
    consumer.db.dispose()


SCRIPT = """
import os, sys
from celery import Celery
from durable_celery import Durable

app = Celery("exiting", broker=os.environ["BROKER"])
app.conf.task_default_queue = os.environ["QUEUE"]
durable = Durable(app, os.environ["DB"], upkeep=False)
durable.workflow("ship").step(lambda order: order, name="pack")
{body}
"""


def run_script(pg_url: str, broker: str, queue: str, body: str) -> list[str]:
    env = {**os.environ, "BROKER": broker, "QUEUE": queue, "DB": pg_url}
    code = SCRIPT.format(body=textwrap.dedent(body))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def sent_run_ids(app: Celery, queue: str) -> list[str]:
    """The run ids of the messages in ``queue``, oldest first (taken off it)."""
    return [message_run_id(message) for message in take_messages(app, queue)]


@pytest.mark.parametrize("backend", BROKERS)
def test_a_process_that_exits_right_after_starting_sends_its_messages(pg_url, broker_url):
    queue = queue_name()
    started = run_script(
        pg_url,
        broker_url,
        queue,
        """
        for n in range(50):
            print(durable.start("ship", {"order": n}, key=f"k{n}"))
        """,
    )
    reader = Celery("reader", broker=broker_url)
    assert sorted(sent_run_ids(reader, queue)) == sorted(started)
    delete_queue(reader, queue)


@pytest.mark.parametrize("backend", BROKERS)
def test_a_forked_child_sends_its_own_messages_and_never_its_parents(pg_url, broker_url):
    queue = queue_name()
    # The parent queues messages and forks at once (its thread may not have sent them yet);
    # a plain os.fork child exits with sys.exit (atexit), a multiprocessing child with os._exit
    # after its finalizers. Each message goes out exactly once.
    started = run_script(
        pg_url,
        broker_url,
        queue,
        """
        import multiprocessing

        def child(tag):
            print(durable.start("ship", {"order": tag}, key=f"child-{tag}"), flush=True)

        parent = [durable.start("ship", {"order": n}, key=f"parent-{n}") for n in range(20)]
        pid = os.fork()
        if pid == 0:
            child("fork")
            sys.exit(0)
        os.waitpid(pid, 0)
        process = multiprocessing.get_context("fork").Process(target=child, args=("mp",))
        process.start()
        process.join()
        print(*parent)
        print(os.getpid(), pid, process.pid)
        """,
    )
    parent_pid, fork_pid, mp_pid = started[-3:]
    started = started[:-3]
    assert len(started) == 22
    reader = Celery("reader", broker=broker_url)
    messages = take_messages(reader, queue)
    assert sorted(message_run_id(m) for m in messages) == sorted(started)  # every one, none twice
    # Each message names the process that sent it as Celery does ("gen<pid>@host").
    origins = {message_run_id(m): m.headers["origin"].split("@")[0] for m in messages}
    assert origins[started[0]] == f"gen{fork_pid}" and origins[started[1]] == f"gen{mp_pid}"
    assert {origins[run_id] for run_id in started[2:]} == {f"gen{parent_pid}"}
    delete_queue(reader, queue)


@pytest.mark.parametrize("backend", BROKERS)
def test_a_send_made_now_survives_its_threads_broken_connection(pg_url, broker_url):
    queue = queue_name()
    durable = make(pg_url, broker_url, queue, publish_in_background=False)
    first = durable.start("ship", {"order": 1})  # sent now, on a producer this thread holds
    held = durable.publisher._thread_producer()

    def broken(*args, **kwargs):
        raise ConnectionResetError("the broker dropped this connection")

    held.producer.publish = broken
    second = durable.start("ship", {"order": 2})  # sent again through send_task's retries
    third = durable.start("ship", {"order": 3})
    assert sorted(sent_run_ids(durable.app, queue)) == sorted([first, second, third])  # each once
    assert published_flags(durable, [first, second, third]) == [True] * 3
    assert durable.publisher._thread_producer() is not held  # a new one replaced it
    delete_queue(durable.app, queue)
    durable.db.dispose()


@pytest.mark.parametrize("backend", BROKERS)
def test_a_next_step_sent_by_a_worker_names_the_task_that_sent_it(pg_url, broker_url):
    from celery.signals import before_task_publish

    queue = queue_name()
    durable = make(pg_url, broker_url, queue, inline_steps=0)
    two = durable.workflow("two")
    two.step(lambda: 1, name="one")
    two.step(lambda: 2, name="two")
    sent: list[dict] = []

    def note(sender=None, headers=None, **_):
        if sender and sender.startswith("durable.two."):
            sent.append(dict(headers))

    before_task_publish.connect(note, weak=False)
    try:
        with worker(durable, queues=[queue]):
            run_id = durable.start(two)
            assert wait_for(durable, run_id).status == "completed"
    finally:
        before_task_publish.disconnect(note)
    first, second = sent
    assert (first["task"], second["task"]) == ("durable.two.one", "durable.two.two")
    assert second["parent_id"] == first["id"]  # Flower links the step to the one that sent it
    assert second["root_id"] == first["id"]
    delete_queue(durable.app, queue)
    durable.db.dispose()


@pytest.mark.parametrize("background", [True, False], ids=["background", "publish_in_background=False"])
def test_a_starts_message_leaves_from_the_publisher_thread_unless_told_otherwise(
    pg_url, redis_client, background
):
    import threading

    from celery.signals import before_task_publish

    queue = queue_name()
    durable = make(pg_url, REDIS_URL, queue, publish_in_background=background)
    threads: list[str] = []

    def note(sender=None, **_):
        if sender == "durable.ship.pack":
            threads.append(threading.current_thread().name)

    before_task_publish.connect(note, weak=False)
    try:
        run_id = durable.start("ship", {"order": 1}, key="k")
        assert durable.flush(timeout=10)
    finally:
        before_task_publish.disconnect(note)
    assert threads == (["durable-publisher"] if background else [threading.current_thread().name])
    assert sent_run_ids(durable.app, queue) == [run_id]
    delete_queue(durable.app, queue)
    durable.db.dispose()


def test_an_idle_publisher_thread_ends_and_the_next_start_brings_another(pg_url, redis_client, monkeypatch):
    import gc
    import weakref

    from durable_celery.worker import publisher

    monkeypatch.setattr(publisher, "IDLE_EXIT", 0.2)
    queue = queue_name()
    durable = make(pg_url, REDIS_URL, queue)
    first_run = durable.start("ship", {"order": 1}, key="first")
    first = durable.publisher._thread
    assert first is not None
    first.join(timeout=10)  # nothing more to send: the thread ends by itself
    assert not first.is_alive() and durable.publisher._thread is None
    second_run = durable.start("ship", {"order": 2}, key="second")
    second = durable.publisher._thread
    assert second is not None and second is not first
    assert durable.flush(timeout=10)
    assert sorted(sent_run_ids(durable.app, queue)) == sorted([first_run, second_run])
    second.join(timeout=10)
    assert not second.is_alive()
    # With its thread gone, nothing of this process keeps a discarded Durable alive.
    delete_queue(durable.app, queue)
    durable.db.dispose()
    gone = weakref.ref(durable.publisher)
    del durable
    Celery("next")  # becomes Celery's current app, which it holds (as it held the last one)
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("backend", BROKERS)
def test_a_fast_stream_waits_a_few_gaps_never_the_whole_linger(pg_url, broker_url):
    queue = queue_name()
    durable = make(pg_url, broker_url, queue, publish_linger=1.0)  # long, so the test reads it plainly
    sizes: list[tuple[float, int]] = []
    send = durable.publisher._send_batch
    slow = threading.Event()

    def counted(batch):
        sizes.append((time.monotonic(), len(batch)))
        if slow.is_set():  # a broker slower than the starts: messages wait for the thread
            time.sleep(0.05)
        return send(batch)

    durable.publisher._send_batch = counted
    began = time.monotonic()
    lone = durable.start("ship", {"order": 0}, key="lone")
    while not sizes:
        assert time.monotonic() - began < 10, "the lone start was never sent"
        time.sleep(0.005)
    assert sizes[0][1] == 1 and sizes[0][0] - began < 0.9  # a start after a quiet spell: at once
    # A stream fast for this linger (a start every 10 ms): a message waits for a few more gaps,
    # never the whole second.
    paced = []
    for n in range(1, 11):
        paced.append(durable.start("ship", {"order": n}, key=f"p-{n}"))
        time.sleep(0.01)
    last = time.monotonic()
    while sum(n for _, n in sizes[1:]) < 10:  # no flush: it would cut a linger short
        assert time.monotonic() - last < 10, sizes
        time.sleep(0.005)
    assert sizes[-1][0] - last < 0.5, sizes
    # Starts back to back while each send takes 50 ms: they share round trips.
    slow.set()
    shown = len(sizes)
    stream = [durable.start("ship", {"order": n}, key=f"s-{n}") for n in range(11, 41)]
    assert durable.flush(timeout=10)
    assert sum(n for _, n in sizes[shown:]) == 30 and len(sizes) - shown <= 8, sizes
    assert sorted(sent_run_ids(durable.app, queue)) == sorted([lone, *paced, *stream])
    delete_queue(durable.app, queue)
    durable.db.dispose()


@pytest.mark.parametrize("backend", BROKERS)
def test_slow_sends_inside_gathering_go_out_together_when_it_ends(pg_url, broker_url):
    queue = queue_name()
    durable = make(pg_url, broker_url, queue)
    sizes: list[int] = []
    send = durable.publisher._send_batch

    def counted(batch):
        sizes.append(len(batch))
        return send(batch)

    durable.publisher._send_batch = counted
    with durable.outbox.gathering():  # a bulk action's page: one retry every 30 ms
        started = []
        for n in range(12):
            started.append(durable.start("ship", {"order": n}, key=f"g-{n}"))
            time.sleep(0.03)  # slower than the publisher lingers for: alone, each would go at once
        assert sizes == []  # held while the block runs
    assert durable.flush(timeout=10)
    assert sizes == [12]
    assert sorted(sent_run_ids(durable.app, queue)) == sorted(started)
    delete_queue(durable.app, queue)
    durable.db.dispose()


@pytest.mark.parametrize("linger", [-0.1, 2, "0.02", True])
def test_publish_linger_outside_0_to_1_second_is_refused(linger):
    from durable_celery.errors import InvalidDefinition

    with pytest.raises(InvalidDefinition, match="publish_linger"):
        Durable(Celery("bad"), "sqlite://", publish_linger=linger)
