"""on_duplicate="run_again": run once more after the holder, with the newest input.

An article is re-indexed on every save. A save while the index run is going must not be lost,
but two index runs of one article must not overlap either: one run waits behind the holder,
without the key, and each further save replaces its input. When the holder ends, the waiting
run takes the key and runs with the newest input.

It uses the testing Fake: steps run when the program calls `run_until_idle()`, and
`advance(seconds)` moves its clock.

    python -m examples.keys_run_again
"""

from __future__ import annotations

from durable_celery import current_run
from durable_celery.testing import Fake

durable = Fake()
index = durable.workflow("index_article", on_duplicate="run_again")


@index.step
def fetch(id, rev):
    print(f"  step ran: fetch article {id} rev {rev}")


@index.step
def write(id, rev):
    current_run().sleep(30)  # a slow search backend: the run is still going meanwhile
    print(f"  step ran: index article {id} rev {rev}")


def main() -> None:
    holder = durable.start(index, {"id": 42, "rev": 1}, key="article:42")
    durable.run_until_idle()  # a worker picked the holder up; it waits in its second step
    print("holder:", durable.get_run(holder).status)

    # Three more saves while the holder is going: one run waits behind it, newest input.
    ids = [durable.start(index, {"id": 42, "rev": rev}, key="article:42") for rev in (2, 3, 4)]
    print("the three saves got one new run:", len(set(ids)) == 1 and holder not in ids)
    behind = durable.get_run(ids[0])
    print("it waits behind the holder:", behind.runs_after_id == holder)
    print("its input, from the newest save:", behind.input)

    durable.advance(30)  # the holder's sleep is over: it finishes, then the run behind it goes
    durable.run_until_idle()
    durable.advance(30)
    durable.run_until_idle()
    print("holder:", durable.get_run(holder).status)
    behind = durable.get_run(ids[0])
    print(f"the run behind it: {behind.status}, holds the key: {behind.holds_key}")
    print("runs with the key:", len(durable.list_runs(key="article:42")))


if __name__ == "__main__":
    main()
