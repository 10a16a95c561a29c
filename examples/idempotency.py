"""Idempotency keys: one run per key while the run is unfinished, and the three policies.

The same keyed start twice gets the first run back; once that run has finished the key is free
again. `idempotency="required"` refuses a start without a key, `"off"` ignores keys. Last, a
backend without the IDEMPOTENCY_KEY capability (the testing Fake told to lack it) refuses a
start that carries a key.

It runs on the in-memory store with a real Celery worker in this process:

    python -m examples.idempotency
"""

from __future__ import annotations

import threading

from celery import Celery

from durable_celery import Capability, Durable, InvalidStart, Unsupported
from durable_celery.testing import Fake, wait_for, worker

app = Celery("idempotency")  # no broker set: the memory store brings Celery's memory:// broker
durable = Durable(app, "memory://")
release = threading.Event()

invoice = durable.workflow("invoice")  # idempotency="optional" (the default): a key is honoured


@invoice.step
def send(order):
    release.wait(10)  # keep the run unfinished until the program says so


payout = durable.workflow("payout", idempotency="required")  # a start without a key fails


@payout.step
def pay(amount):
    pass


ping = durable.workflow("ping", idempotency="off")  # keys are ignored: every start is a run


@ping.step
def pong():
    pass


def main() -> None:
    with worker(durable):
        # The same start twice, one run: a retried HTTP request, a redelivered message.
        first = durable.start("invoice", {"order": 42}, key="invoice:order-42")
        wait_for(durable, first, statuses=("running",))  # the worker is in its step now
        second = durable.start("invoice", {"order": 42}, key="invoice:order-42")
        print("second start returned the first run:", second == first)

        # The first run finishes: the key is free (reuse="after_close", the default).
        release.set()
        wait_for(durable, first)
        third = durable.start("invoice", {"order": 42}, key="invoice:order-42")
        print("after the run finished, a new run:", third != first)
        wait_for(durable, third)

        # A workflow that requires a key.
        try:
            durable.start("payout", {"amount": 10})
            refused = False
        except InvalidStart:  # nothing was written
            refused = True
        print("payout without a key:", refused)

        # A workflow that ignores keys.
        a = durable.start("ping", key="same")
        b = durable.start("ping", key="same")
        print("ping with the same key twice, two runs:", a != b)
        wait_for(durable, a)
        wait_for(durable, b)

    # A backend without the capability refuses the key, before anything is written.
    fake = Fake(capabilities=Capability.ALL & ~Capability.IDEMPOTENCY_KEY)
    fake_invoice = fake.workflow("invoice")

    @fake_invoice.step
    def send_again(order):
        pass

    try:
        fake.start("invoice", {"order": 42}, key="invoice:order-42")
    except Unsupported as exc:
        print("no IDEMPOTENCY_KEY:", exc)


if __name__ == "__main__":
    main()
