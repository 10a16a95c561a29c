"""on_duplicate=SendEvent(name): a duplicate start hands its input to the running holder.

An article is processed once per key; a save that arrives while it is being processed is sent
to that run as the event "article_updated" (Temporal's Signal-With-Start). The run's last step
waits for it with `current_run().wait_for_event(...)`, parked with no worker slot held, and
resumes when it comes. No second run is created.

It uses the testing Fake: steps run when the program calls `run_until_idle()`.

    python -m examples.keys_send_event
"""

from __future__ import annotations

from durable_celery import SendEvent, current_run
from durable_celery.testing import Fake

durable = Fake()
process = durable.workflow("process_article", on_duplicate=SendEvent("article_updated"))


@process.step
def publish(id, rev):
    print(f"  step ran: publish article {id} rev {rev}")


@process.step
def catch_up(id, rev):
    # The step runs again from the top when the event comes: nothing before the wait here.
    update = current_run().wait_for_event("article_updated", timeout=300, timeout_value=None)
    print(f"  step ran: catch up with rev {update['rev']}" if update else "  step ran: no update")


def main() -> None:
    holder = durable.start(process, {"id": 42, "rev": 8}, key="article:42")
    durable.run_until_idle()
    print("the run waits for an update:", durable.get_run(holder).status)

    again = durable.start(process, {"id": 42, "rev": 9}, key="article:42")  # a later save
    print("the second start returned the holder:", again == holder)
    entry = durable.activity(kinds="key_duplicate")[0]
    print("activity outcome:", entry.details["outcome"], "event:", entry.details["event"])

    durable.run_until_idle()
    print("holder:", durable.get_run(holder).status)
    print("runs with the key:", len(durable.list_runs(key="article:42")))


if __name__ == "__main__":
    main()
