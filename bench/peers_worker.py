"""A worker process of DBOS or procrastinate for ``bench.peers``.

    python -m bench.peers_worker dbos|procrastinate INDEX CONCURRENCY

Its environment carries the database (``BENCH_PEERS_DB``), the bench's Redis
(``BENCH_PEERS_REDIS``: readiness and finished runs) and the folder of step times
(``BENCH_PEERS_DIR``). Celery's workers are ``celery worker`` itself.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    """Serve as a worker of the system named in ``argv`` until stopped."""
    system, index, concurrency = argv[0], int(argv[1]), int(argv[2])
    if system == "dbos":
        from bench import peers_dbos_app

        peers_dbos_app.serve(index, concurrency)
    elif system == "procrastinate":
        from bench import peers_procrastinate_app

        peers_procrastinate_app.serve(index, concurrency)
    else:
        raise SystemExit(f"no worker for {system!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
