"""A key racer: ``--threads`` threads starting the same few keys of ``keyed`` with every
``on_duplicate`` policy once the file ``--go`` exists (it prints ``ready`` before it waits),
until the file ``--stop`` exists or ``--seconds`` passed; one JSON line per start to ``--out``.
The harness runs four of these (``load.Racers``) beside the workers, configured by the workers'
environment (``CHAOS_BROKER``, ``CHAOS_DB``, ``CHAOS_QUEUE``, ``CHAOS_SETTINGS``)."""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time

from tests.chaos.load import dump, pick_start, start_one
from tests.chaos.workflows import make_producer, new_input

KEYS = 3  # a few keys, so that starts of one key really meet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--go", required=True, help="begin once this file exists")
    parser.add_argument("--stop", required=True, help="stop once this file exists")
    parser.add_argument("--seconds", type=float, default=600.0, help="stop after this long at most")
    parser.add_argument("--pause", type=float, default=0.25, help="mean seconds between a thread's starts")
    args = parser.parse_args()
    settings = json.loads(os.environ["CHAOS_SETTINGS"])
    env = os.environ
    client = make_producer(env["CHAOS_BROKER"], env["CHAOS_DB"], env["CHAOS_QUEUE"], settings, "chaos-racer")
    lock = threading.Lock()
    print("ready", flush=True)
    while not os.path.exists(args.go):
        time.sleep(0.02)
    end = time.time() + args.seconds
    with open(args.out, "w") as out:

        def race(n: int) -> None:
            rng = random.Random(args.seed * 1000 + n)
            while time.time() < end and not os.path.exists(args.stop):
                workflow, key, policy = pick_start(rng, KEYS, "race", 1.0)
                rec = start_one(client, workflow, new_input(rng, long_share=0.0), key, policy)
                with lock:
                    out.write(dump(rec) + "\n")
                    out.flush()
                time.sleep(args.pause * rng.uniform(0.2, 1.8))

        threads = [threading.Thread(target=race, args=(n,)) for n in range(args.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    client.db.dispose()


if __name__ == "__main__":
    main()
