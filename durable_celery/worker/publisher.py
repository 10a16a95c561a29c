"""Sending step messages: now (``send_now``), or soon from a background thread (``send_soon``).

A start commits its run with ``published=true`` and ``due_at`` set, then hands the first step's
message to this process's ``Publisher`` (a start without a key on PostgreSQL, while its INSERT
commits: keys.start_run). Its thread sends whatever has queued up since its last pass in one
kombu publish batch (one producer it holds, one Redis pipeline; while starts come faster than one
a millisecond it waits for a few more, never over ``publish_linger``), so a caller pays for an
append to a list instead of building and sending a Celery message.

The caller never waits for the broker: ``send_soon`` appends and, for the first message,
starts the thread; the connection is made from that thread, so a start returns in microseconds
whether the broker is up, refusing connections or not answering at all.

Nothing gets weaker, because the run row is the outbox:

- a batch the broker refuses is tried again ``publish_retries`` times on a new connection (each
  connection one attempt, no kombu retry loop); then its runs are flagged ``published=false``
  and the relay sends them at its next pass. While the broker stays away, each later batch gets
  one attempt before it is flagged. On RabbitMQ a message counts as sent only once the broker
  confirmed it (publisher confirms, ``confirm_publish``, on unless the app's
  ``broker_transport_options`` turn them off): a nack, or no confirm within ``SOCKET_TIMEOUT``,
  is a refusal like any other;
- a worker flushes after every task (``task_postrun``), so what a step started is sent before
  its task is acknowledged, and a forked child starts with an empty queue of its own (the parent
  sends what it queued). At exit the runs of held messages are flagged for the relay first."""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing.util
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, signals
from celery.utils.nodenames import anon_nodename
from kombu.utils.uuid import uuid

from ..instrument import tracing

log = logging.getLogger("durable_celery")

BATCH = 500  # messages per kombu batch (one pipeline round trip on Redis)
# While messages come fast, the thread waits for a few more before it sends, so that one batch
# carries them: one start from a loop cost the process 0.39 to 0.49 ms of CPU with batches, 0.62
# to 0.87 ms sent one by one (6 Dec 2026). A message waits at most GAPS mean gaps and never over
# this (setting ``publish_linger``); in a slower stream it goes at once (docs/performance.md).
LINGER = 0.02
FAST_PACE = 0.05  # fast: a mean gap under this part of ``linger`` (1,000 a second at the default)
GAPS = 8.0
GATHER_CHECK = 1.0  # inside gathering(): how often the lingering thread looks again
GAP_WEIGHT = 0.5  # how much the newest gap moves the mean gap
EXIT_FLUSH_SECONDS = 30.0  # the longest a worker's flush after a task waits (task_postrun)
# At exit, after the held runs are flagged for the relay, how long the broker gets to take them.
EXIT_SECONDS = 1.0
PAUSES = (0.2, 0.7, 1.0)  # between the tries of a batch the broker refused (then 1 s each)
# The socket timeouts of our Redis connections (unless ``broker_transport_options`` sets its
# own): a broker that takes connections and never answers holds a try about twice this long.
# On RabbitMQ, the longest a publish waits for the broker's confirm.
SOCKET_TIMEOUT = 5.0
# The thread ends after this long with nothing to send (the next ``send_soon`` starts another),
# so an idle process, or a discarded ``Durable``, keeps no thread (nor the app it refers to).
IDLE_EXIT = 5.0


@dataclass(frozen=True)
class Message:
    """One step message: which task, for which run, and how Flower shows it."""

    task_name: str
    step_name: str
    step_index: int
    run_id: str
    attempt: int
    key: str | None
    queue: str | None
    compensate: bool = False
    # Caught in the caller's thread for a message sent from the background thread: the task
    # that started this run (Flower's parent and root), and the caller's OpenTelemetry context
    # (so instrumentation that stamps headers at ``before_task_publish`` sees the caller's span).
    parent_id: str | None = None
    root_id: str | None = None
    context: Any = None

    def kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"run_id": self.run_id, "step": self.step_index, "attempt": self.attempt}
        if self.compensate:
            kwargs["phase"] = "compensate"
        return kwargs

    def kwargsrepr(self) -> str:
        """How Flower shows the task's kwargs."""
        from .task_states import shown_kwargs

        return shown_kwargs(self.run_id, self.key, self.step_name, self.attempt, self.compensate)


@dataclass
class Route:
    """What every message of one step task to one queue shares, worked out once."""

    options: dict[str, Any]
    expires: Any
    time_limit: Any
    soft_time_limit: Any
    sent_event: bool


@dataclass
class Held:
    """A producer one thread holds for its sends, and what it declared."""

    producer: Any
    pid: int
    declared: set[tuple[str, str | None]] = field(default_factory=set)


class Publisher:
    """Sends step messages for one Celery app; flags runs for the relay when it cannot."""

    def __init__(
        self,
        app: Celery,
        flag_unsent: Callable[[Sequence[str]], None],
        retries: int,
        linger: float = LINGER,
    ) -> None:
        self.app = app
        self._flag_unsent = flag_unsent
        self.linger = linger
        self.retries = retries
        self._policy = {
            "max_retries": retries,
            "interval_start": 0.2,
            "interval_step": 0.5,
            "interval_max": 1.0,
        }
        self._reset()
        _live.add(self)

    def _reset(self) -> None:
        """Fresh state: at creation, and in a forked child (whose parent sends what it queued;
        locks, a thread or a connection copied mid-way are never touched again)."""
        if getattr(self, "_producer", None) is not None:
            _abandoned.append(self._producer)  # never closed here: its socket is the parent's
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._queue: deque[Message] = deque()
        self._sending = 0  # messages taken off the queue and not yet sent or flagged
        self._in_flight: list[list[Message]] = []  # those messages, batch by batch
        self._leaving = False  # the process exits: one try per batch, no pauses
        self._options: dict[str, Any] | None = None  # transport options of our connections
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._idle = False  # the thread waits for a first message: wake it for one
        self._hurry = False  # a flush waits: stop lingering
        self._gathering = 0  # callers inside gathering(): hold messages for one batch
        self._arrived, self._gap = 0.0, self.linger  # the last message's monotonic time; the mean gap
        self._failing = False  # log a broker outage once, not once per batch
        # The producer of background sends, one connection held; used under _send_lock only.
        self._send_lock = threading.Lock()
        self._producer: Any = None
        self._declared: set[tuple[str, str | None]] = set()  # queues declared on that connection
        self._redis = False
        self._confirm: dict[str, Any] = {}  # on RabbitMQ with confirms: how long to wait for one
        self._routes: dict[tuple[str, str | None], Route] = {}  # per step task and queue
        # The message's "origin" as Celery writes it (gen<pid>@host), made once per process
        # instead of once per message.
        self._origin = anon_nodename()
        # Producers of sends made now (a worker's next step, retries, the relay), one per thread.
        self._local = threading.local()

    def reconnect(self, timeout: float = 10.0) -> None:
        """Send what is queued, then send on new connections, made with the app's options now."""
        self.flush(timeout=timeout)
        with self._send_lock:
            self._drop_producer()
        self._local = threading.local()  # each thread's producer is made anew on its next send
        self._options = None

    # -- sending ------------------------------------------------------------------------------

    def send_now(self, message: Message) -> bool:
        """Send one message now, on a producer this thread holds; if the broker refuses, again
        through ``app.send_task`` with the retry policy; on failure flag its run and return False."""
        try:
            held = self._thread_producer()
            self._emit(message, held.producer, held.declared)
            return True
        except Exception:  # a broken connection: the retrying send below makes a new one
            self._local.held = None
        try:
            self._send_task(message)
            return True
        except Exception as exc:  # the broker is away: the relay sends it when it is back
            log.warning("durable: could not publish run %s (%s); the relay will", message.run_id, exc)
            self._flag([message.run_id])
            return False

    def send_soon(self, message: Message) -> None:
        """Queue a message for the background thread (started here on first use)."""
        if self._pid != os.getpid():  # a fork the hook did not see (it always should)
            self._reset()
        with self._cond:
            now = time.monotonic()
            # The mean gap between messages (weighing the last ones most), capped at ``linger``:
            # one pause counts as a slow pace at once, and a few quick ones as a fast one.
            gap = self._gap * (1 - GAP_WEIGHT) + (now - self._arrived) * GAP_WEIGHT
            self._gap = min(gap, self.linger)
            self._arrived = now
            self._queue.append(message)
            if self._thread is None or not self._thread.is_alive():
                self._start_thread()
            elif self._idle or len(self._queue) >= BATCH:
                self._cond.notify()  # a lingering thread is not woken per message

    @contextlib.contextmanager
    def gathering(self) -> Iterator[None]:
        """Hold the block's background sends (up to a batch) and send them together at its end."""
        with self._cond:
            self._gathering += 1
        try:
            yield
        finally:
            with self._cond:
                self._gathering -= 1
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message queued so far is sent or flagged; False on timeout.

        Sends them in this thread if no background thread can (it was never started here, or
        the interpreter is shutting down).
        """
        if self._pid != os.getpid():
            self._reset()
            return True
        while True:
            with self._cond:
                if not self._queue and not self._sending:
                    return True
                if not self._queue or (self._thread is not None and self._thread.is_alive()):
                    self._hurry = True
                    self._cond.notify_all()
                    return self._cond.wait_for(lambda: not self._queue and not self._sending, timeout)
                batch = self._take()
            try:
                self._send_batch(batch)
            finally:
                self._done(batch)

    def pending(self) -> int:
        """Messages queued or being sent."""
        return len(self._queue) + self._sending

    def close(self, timeout: float | None = EXIT_FLUSH_SECONDS) -> None:
        """Flush, then stop the background thread."""
        self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def leave(self) -> bool:
        """At exit: flag the runs of every message still held for the relay (one statement)
        and let the thread send them with one try each; False when nothing was held."""
        if self._pid != os.getpid():  # a fork the hook did not see: the parent sends its own
            self._reset()
            return False
        with self._cond:
            held = [m.run_id for m in self._queue] + [m.run_id for b in self._in_flight for m in b]
            self._leaving = self._hurry = True
            self._cond.notify_all()
            if self._queue and (self._thread is None or not self._thread.is_alive()):
                with contextlib.suppress(RuntimeError):  # no new thread at this stage of the exit
                    self._start_thread()
        self._flag(held)
        return bool(held)

    def _wait_sent(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every message held to be sent or flagged."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._sending, max(timeout, 0.0))

    # -- the background thread -----------------------------------------------------------------

    def _start_thread(self) -> None:
        # Import the transport here, in the caller's thread (importing it from the new thread
        # could leave a child forked meanwhile with a half-imported module); connect there.
        if self._options is None:
            with contextlib.suppress(Exception):  # a bad URL: the thread's send reports it
                self._connection_options()
                self.app.amqp.Producer  # noqa: B018 - Celery's AMQP, made (not connected) here
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="durable-publisher", daemon=True)
        self._thread.start()

    def _take(self) -> list[Message]:
        """Take up to BATCH messages off the queue (the condition's lock is held)."""
        batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
        self._sending += len(batch)
        self._in_flight.append(batch)
        return batch

    def _done(self, batch: list[Message]) -> None:
        with self._cond:
            self._sending -= len(batch)
            with contextlib.suppress(ValueError):  # a fork reset the list meanwhile
                self._in_flight.remove(batch)
            self._cond.notify_all()

    def _loop(self) -> None:
        cond = self._cond  # a fork replaces it; this thread keeps the one it started with
        while True:
            with cond:
                self._idle = True
                woken = cond.wait_for(
                    lambda: self._queue or self._stopping or cond is not self._cond, IDLE_EXIT
                )
                self._idle = False
                if cond is not self._cond or (self._stopping and not self._queue):
                    return
                if not woken:  # idle: hand over to the thread the next send_soon starts
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                self._linger(cond)
                batch = self._take()
            try:
                self._send_batch(batch)
            except Exception:  # never let the thread die: the relay covers what was not sent
                log.exception("durable: publishing %d message(s) failed; the relay sends them", len(batch))
            finally:
                self._done(batch)

    def _linger(self, cond: threading.Condition) -> None:
        """While messages come fast (their mean gap under ``FAST_PACE`` of ``linger``), wait for
        about ``GAPS`` more (never over ``linger``), so one batch carries them; in a slower stream
        each goes at once. Inside ``gathering()``: until it ends or a batch is full."""
        if not self._gathering and (not self.linger or self._gap > self.linger * FAST_PACE):
            return
        deadline = time.monotonic() + min(self.linger, GAPS * self._gap)
        while len(self._queue) < BATCH and not (self._hurry or self._stopping):
            left = GATHER_CHECK if self._gathering else deadline - time.monotonic()
            if left <= 0 or cond is not self._cond:
                break
            cond.wait(left)
        self._hurry = False

    def _send_batch(self, batch: list[Message]) -> None:
        """Send on the held producer (a kombu batch, one Redis pipeline, when there are several);
        if the broker refuses, try again on a new connection ``publish_retries`` times (once
        while it is known to be away, or the process exits), then flag the runs for the relay."""
        with self._send_lock:
            tries = 1 if (self._failing or self._leaving) else 1 + self.retries
            for attempt in range(tries):
                if attempt and self._pause(PAUSES[min(attempt, len(PAUSES)) - 1]):
                    break  # the process exits: no more waiting on the broker
                try:
                    self._emit_batch(batch)
                except Exception as exc:
                    self._drop_producer()
                    error = exc
                    continue
                if self._failing:
                    self._failing = False
                    log.warning("durable: publishing works again")
                return
            if not self._failing:
                self._failing = True
                log.warning(
                    "durable: the broker refused %d message(s) (%s); the relay sends them", len(batch), error
                )
        self._flag([m.run_id for m in batch])

    def _emit_batch(self, batch: list[Message]) -> None:
        """Send a batch on the held producer, made now if there is none."""
        producer = self._held_producer()
        if len(batch) == 1:
            self._emit(batch[0], producer, self._declared)
            return
        with producer.batch(max_size=BATCH):
            for message in batch:
                self._emit(message, producer, self._declared)

    def _pause(self, seconds: float) -> bool:
        """Wait between two tries; True (at once) when the process is leaving."""
        with self._cond:
            return self._cond.wait_for(lambda: self._leaving, seconds)

    def _held_producer(self) -> Any:
        if self._producer is None:
            self._producer = self._new_producer()
            self._declared = set()
        return self._producer

    def _new_producer(self) -> Any:
        """A producer on a connection of its own, made with one attempt (kombu's own loop would
        retry for ``broker_connection_timeout``), its Redis client reused (``_hold_redis_client``)."""
        connection = self.app.connection_for_write(transport_options=self._connection_options())
        try:
            connection.ensure_connection(max_retries=0)
        except BaseException:
            with contextlib.suppress(Exception):
                connection.release()
            raise
        producer = self.app.amqp.Producer(connection, auto_declare=False)
        self._redis = connection.transport.driver_type == "redis"
        if self._redis:
            _hold_redis_client(producer.channel)
        return producer

    def _connection_options(self) -> dict[str, Any]:
        """Socket timeouts for our Redis connections, publisher confirms for our RabbitMQ ones,
        where the app sets none (importing the transport's module on first use)."""
        if self._options is None:
            own = self.app.conf.broker_transport_options or {}
            driver = self.app.connection_for_write().get_transport_cls().driver_type
            names = ("socket_timeout", "socket_connect_timeout") if driver == "redis" else ()
            options: dict[str, Any] = {name: SOCKET_TIMEOUT for name in names if name not in own}
            if driver == "amqp":
                options["confirm_publish"] = own.get("confirm_publish", True)
                if options["confirm_publish"]:
                    self._confirm = {"confirm_timeout": SOCKET_TIMEOUT}
            self._options = options
        return self._options

    def _thread_producer(self) -> Held:
        """This thread's producer for sends made now (made on first use, and anew in a fork)."""
        held: Held | None = getattr(self._local, "held", None)
        if held is None or held.pid != os.getpid():
            held = self._local.held = Held(self._new_producer(), os.getpid())
        return held

    def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):  # already broken: nothing to release
                producer.connection.close()

    def _send_task(self, message: Message) -> None:
        """``app.send_task`` on a connection of ours (publisher confirms on RabbitMQ), with the
        retry policy."""
        options: dict[str, Any] = {"queue": message.queue} if message.queue else {}
        with self.app.connection_for_write(transport_options=self._connection_options()) as conn:
            self.app.send_task(
                message.task_name,
                kwargs=message.kwargs(),
                serializer="json",
                argsrepr="()",
                kwargsrepr=message.kwargsrepr(),
                retry=True,
                retry_policy=self._policy,
                add_to_parent=False,
                ignore_result=True,
                connection=conn,
                **options,
                **self._confirm,
            )

    def _emit(self, message: Message, producer: Any, declared: set[tuple[str, str | None]]) -> None:
        """What ``app.send_task`` does, on the held producer, with the routing of the step's
        task worked out once (``_route``): Celery builds the message (``create_task_message``,
        the app's task protocol) and sends it (``send_task_message``: the publish signals,
        the task-sent event when enabled)."""
        amqp = self.app.amqp
        route = self._route(message.task_name, message.queue)
        options = dict(route.options)
        if self._redis and (message.task_name, message.queue) in declared:
            options["declare"] = []  # a Redis queue needs declaring once per connection
        built = amqp.create_task_message(
            uuid(),
            message.task_name,
            (),
            message.kwargs(),
            expires=route.expires,
            reply_to=self.app.thread_oid,
            origin=self._origin,
            time_limit=route.time_limit,
            soft_time_limit=route.soft_time_limit,
            create_sent_event=route.sent_event,
            root_id=message.root_id,
            parent_id=message.parent_id,
            ignore_result=True,  # step tasks keep no result (and no result backend subscription)
            argsrepr="()",
            kwargsrepr=message.kwargsrepr(),
            **options,
        )
        with tracing.attached(message.context):
            amqp.send_task_message(
                producer, message.task_name, built, retry=False, **options, **self._confirm
            )
        declared.add((message.task_name, message.queue))

    def _route(self, task_name: str, queue: str | None) -> Route:
        """How messages of a step task reach ``queue``: the task's options and the app's routes
        (``task_routes``), resolved once per task and queue (routes that look at a message's
        arguments are not supported)."""
        route = self._routes.get((task_name, queue))
        if route is None:
            task = self.app.tasks.get(task_name)
            options = {k: v for k, v in (task._get_exec_options() if task else {}).items() if v is not None}
            if queue:
                options["queue"] = queue
            options = self.app.amqp.router.route(options, task_name, (), {}, task)
            options["serializer"] = "json"
            for name in ("argsrepr", "kwargsrepr", "ignore_result", "retry", "retry_policy", "producer"):
                options.pop(name, None)
            route = Route(
                options=options,
                expires=options.pop("expires", None),
                time_limit=options.pop("time_limit", None),
                soft_time_limit=options.pop("soft_time_limit", None),
                sent_event=bool(self.app.conf.task_send_sent_event),
            )
            self._routes[(task_name, queue)] = route
        return route

    def _flag(self, run_ids: Sequence[str]) -> None:
        if not run_ids:
            return
        try:
            self._flag_unsent(run_ids)
        except Exception as exc:  # the database is away too: the relay re-sends after relay_after
            log.warning("durable: could not flag %d unsent run(s) for the relay (%s)", len(run_ids), exc)


_live: weakref.WeakSet[Publisher] = weakref.WeakSet()
# Producers a forked child inherited: kept, never closed (closing could touch the parent's socket).
_abandoned: list[Any] = []


def flush_all(timeout: float | None = EXIT_FLUSH_SECONDS) -> bool:
    """Flush every publisher of this process; False if one timed out."""
    return all([publisher.flush(timeout) for publisher in list(_live)])


def leave_all(seconds: float = EXIT_SECONDS) -> bool:
    """At exit: flag what every publisher holds, then give the broker ``seconds`` in all to
    take it (``Publisher.leave``); False if something was left unsent."""
    publishers = [publisher for publisher in list(_live) if publisher.leave()]
    deadline = time.monotonic() + seconds
    return all([publisher._wait_sent(deadline - time.monotonic()) for publisher in publishers])


def _after_fork_in_child() -> None:
    for publisher in list(_live):
        publisher._reset()


def _flush_after_task(**_: Any) -> None:
    if any(publisher.pending() for publisher in list(_live)):
        flush_all()


class _ForkMarker:
    """Keeps the multiprocessing after-fork hook registered (its registry holds weak refs)."""


def _flush_on_multiprocessing_exit(_marker: _ForkMarker) -> None:
    # A multiprocessing child leaves through os._exit after running its finalizers, not atexit.
    multiprocessing.util.Finalize(None, leave_all, exitpriority=0)


_marker = _ForkMarker()
os.register_at_fork(after_in_child=_after_fork_in_child)
multiprocessing.util.register_after_fork(_marker, _flush_on_multiprocessing_exit)
atexit.register(leave_all)
# Celery's pool processes leave with os._exit (no atexit): leave when one shuts down; flush
# after every task, so that what a step started is sent before its task is acknowledged.
signals.worker_process_shutdown.connect(lambda **_: leave_all(), weak=False)
signals.task_postrun.connect(_flush_after_task, weak=False)


def _hold_redis_client(channel: Any) -> None:
    """Make kombu's Redis channel reuse one client for its publishes. It builds a new
    ``redis.Redis`` (and its table of response callbacks) for every publish and every batch,
    which cost more CPU than the rest of the send; this channel is the publisher's alone, and
    its connections still come from the channel's pool, so a broken one is replaced there."""
    create = getattr(channel, "_create_client", None)
    if create is None:
        return
    held: list[Any] = []

    def reuse(asynchronous: bool = False) -> Any:
        if asynchronous:
            return create(asynchronous=True)
        if not held:
            held.append(create())
        return held[0]

    channel._create_client = reuse
