"""A saga: when a later step fails for good, the completed steps are undone in reverse order.

A trip books a flight, then a hotel, then charges the card. The charge is declined, so the
run compensates: the hotel is cancelled, then the flight. The step that failed is not
compensated (it did not complete), and the run ends `compensated`, keeping the error.

It uses the testing Fake: steps run when the program calls `run_until_idle()`.

    python -m examples.saga
"""

from __future__ import annotations

from durable_celery import current_run
from durable_celery.testing import Fake

durable = Fake()
trip = durable.workflow("trip")


def cancel_flight(city):
    print(f"  compensation ran: cancel flight {current_run().context['flight']}")


def cancel_hotel(city):
    print(f"  compensation ran: cancel hotel in {city}")


@trip.step(compensate=cancel_flight)
def book_flight(city):
    current_run().context["flight"] = "LH 400"  # the context holds JSON values
    print(f"  step ran: book flight LH 400 to {city}")


@trip.step(compensate=cancel_hotel)
def book_hotel(city):
    print(f"  step ran: book hotel in {city}")


@trip.step  # no compensate: nothing to undo if it fails
def pay(city):
    print("  step ran: charge the card")
    raise RuntimeError("card declined")


def main() -> None:
    run_id = durable.start(trip, {"city": "Lisbon"})
    durable.run_until_idle()
    run = durable.get_run(run_id)
    print("run:", run.status)
    print("error kept:", run.error["message"])
    for step in durable.list_steps(run_id):  # every attempt, compensations included
        print(f"recorded: {step.phase} {step.name} {step.status}")


if __name__ == "__main__":
    main()
