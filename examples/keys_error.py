"""on_duplicate="error": a duplicate start raises KeyTaken, naming the holder.

An invoice is sent once: with `reuse="never"` its key stays taken even after the run has
completed, so every later start raises `KeyTaken` too. A single call can still ask for the
holder's id instead, with `on_duplicate="use_existing"`.

It uses the testing Fake: steps run when the program calls `run_until_idle()`.

    python -m examples.keys_error
"""

from __future__ import annotations

from durable_celery import KeyTaken
from durable_celery.testing import Fake

durable = Fake()
send_invoice = durable.workflow("send_invoice", reuse="never", on_duplicate="error")


@send_invoice.step
def send(id):
    print(f"  step ran: invoice {id} sent")


def start_again(first: str) -> str:
    """Start the same invoice again; say what happened."""
    try:
        durable.start(send_invoice, {"id": "INV-2208"}, key="invoice:INV-2208")
    except KeyTaken as exc:  # nothing was written
        return f"KeyTaken, holder is the first run: {exc.holder_id == first}"
    return "a new run"


def main() -> None:
    first = durable.start(send_invoice, {"id": "INV-2208"}, key="invoice:INV-2208")
    print("again while the first run is pending:", start_again(first))
    durable.run_until_idle()
    print("first run:", durable.get_run(first).status)
    print("again after it completed:", start_again(first))  # reuse="never" keeps the key

    # The same call, answered with the holder's id instead of an exception.
    holder = durable.start(
        send_invoice, {"id": "INV-2208"}, key="invoice:INV-2208", on_duplicate="use_existing"
    )
    print("on_duplicate='use_existing' for one call returns it:", holder == first)


if __name__ == "__main__":
    main()
