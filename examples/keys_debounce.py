"""debounce: a burst of keyed starts becomes one run with the newest input.

An editor saves an article five times in under a minute. With `debounce={"period": 30}`, each
keyed start waits 30 seconds before it runs, and each further start with the key in that time
replaces the input and restarts the wait: one run, with the last save. `timeout` caps the
wait, counted from the first start, for a stream of saves that never pauses.

It uses the testing Fake: `advance(seconds)` moves its clock, so the waits take no time, and
steps run when the program calls `run_until_idle()`.

    python -m examples.keys_debounce
"""

from __future__ import annotations

from durable_celery.testing import Fake

durable = Fake()
update_search = durable.workflow("update_search", debounce={"period": 30, "timeout": 300})


@update_search.step
def reindex(id, rev):
    print(f"  step ran: reindex article {id} rev {rev}")


def main() -> None:
    ids = []
    for rev in range(1, 6):  # five saves, 10 seconds apart
        ids.append(durable.start(update_search, {"id": 42, "rev": rev}, key="article:42"))
        durable.advance(10)
        durable.run_until_idle()  # nothing is due: every save restarted the wait
    print("five saves, one run:", len(set(ids)) == 1)
    print("10 s after the last save:", durable.get_run(ids[0]).status)

    durable.advance(20)  # 30 s without a save: the run is due
    durable.run_until_idle()
    run = durable.get_run(ids[0])
    print("30 s after the last save:", run.status, "with", run.input)

    # A save every 10 s that never pauses: the timeout starts the run 300 s after the first.
    ran_at = None
    for rev in range(1, 31):  # saves at 0, 10, ..., 290 s
        durable.start(update_search, {"id": 7, "rev": rev}, key="article:7")
        durable.advance(10)
        if durable.run_until_idle() and ran_at is None:
            ran_at = rev * 10
    print("a save every 10 s: the run started", ran_at, "s after the first save")


if __name__ == "__main__":
    main()
