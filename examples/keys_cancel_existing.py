"""on_duplicate="cancel_existing": a newer start replaces the run holding the key.

A report is rebuilt whenever its data changes; a rebuild of old data is useless once newer
data is there. The second start cancels the holder (which is waiting between its steps) and
starts a new run with the new input, in one transaction: the old run never publishes.

It uses the testing Fake: steps run when the program calls `run_until_idle()`, and
`advance(seconds)` moves its clock.

    python -m examples.keys_cancel_existing
"""

from __future__ import annotations

from durable_celery import current_run
from durable_celery.testing import Fake

durable = Fake()
report = durable.workflow("report", on_duplicate="cancel_existing")


@report.step
def build(account, rev):
    print(f"  step ran: build report {account} from rev {rev}")


@report.step
def publish(account, rev):
    current_run().sleep(60)  # the run waits here, worker freed, before it publishes
    print(f"  step ran: publish report {account} rev {rev}")


def main() -> None:
    old = durable.start(report, {"account": 7, "rev": 1}, key="report:7")
    durable.run_until_idle()
    print("first run:", durable.get_run(old).status)

    new = durable.start(report, {"account": 7, "rev": 2}, key="report:7")  # newer data
    print("the second start made a new run:", new != old)
    print("first run:", durable.get_run(old).status)

    durable.run_until_idle()
    durable.advance(60)  # the sleep is over
    durable.run_until_idle()
    print("second run:", durable.get_run(new).status, durable.get_run(new).input)
    print("holder of the key is the second run:", durable.list_keys()[0].holder_id == new)


if __name__ == "__main__":
    main()
