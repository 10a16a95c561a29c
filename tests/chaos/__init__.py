"""The chaos suite: real ``celery worker`` processes on a PostgreSQL server and a Redis server
that the suite starts for itself, killed, stopped and restarted under load while every step
execution is counted in a ledger table (docs/reliability.md).

- ``workflows.py``: the workflows the workers run and the ledger each step writes to;
  ``app.py`` is the worker's ``-A`` module.
- ``cluster.py``: the servers and the worker processes; ``faults.py``: what is done to them.
- ``load.py``: producer threads, key racers (``racer.py``, other processes) and the key sampler.
- ``checks.py``: what the database and the ledger must show afterwards, and the table.
- ``scenarios.py``: one scenario from start to report (tests and soak share it).
- ``python -m tests.chaos --minutes 10``: the soak (``soak.py``).
"""
