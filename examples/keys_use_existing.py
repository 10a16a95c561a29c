"""on_duplicate="use_existing" (the default): a duplicate start gets the holder's id.

While a run holds its key, a second start with that key creates nothing: it returns the
holder's id and drops its own input. The dropped input is not lost from sight: the activity
log records it, with whether it differed from the holder's.

It uses the testing Fake: steps run when the program calls `run_until_idle()`.

    python -m examples.keys_use_existing
"""

from __future__ import annotations

from durable_celery.testing import Fake

durable = Fake()
sync = durable.workflow("sync_account")  # on_duplicate="use_existing" is the default


@sync.step
def fetch(account, reason):
    print(f"  step ran: sync account {account} ({reason})")


def main() -> None:
    first = durable.start(sync, {"account": 7, "reason": "nightly"}, key="sync:account:7")
    # The same account again while the first run is still pending: a duplicate.
    second = durable.start(sync, {"account": 7, "reason": "button"}, key="sync:account:7")
    print("the duplicate got the holder's id:", second == first)

    entry = durable.activity(kinds="key_duplicate")[0]  # newest first
    print("activity:", entry.kind, "outcome", entry.details["outcome"])
    print("dropped input:", entry.details["input"], "differed:", entry.details["input_changed"])

    durable.run_until_idle()  # one run, with the first input
    print("runs with the key:", len(durable.list_runs(key="sync:account:7")))
    print("holder:", durable.get_run(first).status)


if __name__ == "__main__":
    main()
