"""Testing Django code that starts runs: ``DurableTransactionTestCase``, a ``TransactionTestCase``
that leaves no durable connection behind, and ``release_durable_connections()``, what it calls.

Use a ``TransactionTestCase``, not a ``TestCase``, whenever a worker must see a run: a
``TestCase`` wraps each test in one transaction that is never committed, so a start inside it
joins that transaction (``CELERY_DURABLE_JOIN_ATOMIC``), its first message waits for a commit
that never comes, and a worker, on its own connections, never sees the run or the rows it reads.

Durable keeps a pool of its own on the alias's database (the test database, once Django's runner
switched to it). Django drops the test database at the end of the run and fails with ``database
"test_..." is being accessed by other users`` while any connection is open on it: this test case
closes durable's after each test and each test class. See docs/django.md.

On a shared Redis, the test case sends durable's messages under a key prefix of the test
session's own, so a developer's ``celery -A proj worker`` on the same broker never takes them; on
another broker it refuses to start, naming the queue, when a worker outside the session consumes
one of durable's queues.
"""

from __future__ import annotations

import logging

from django.test import TransactionTestCase

from ...worker.isolation import isolate_durable
from .durable import DEFAULT_ALIAS, DjangoDurable, _made, durable_for

__all__ = ["DurableTransactionTestCase", "release_durable_connections"]

log = logging.getLogger("durable_celery")

FLUSH_TIMEOUT = 10.0


def release_durable_connections(timeout: float = FLUSH_TIMEOUT) -> bool:
    """Send what every DjangoDurable queued, then close its pool; False if a flush timed out."""
    flushed = True
    for durable in list(_made.values()):
        flushed = _release(durable, timeout) and flushed
    return flushed


def _release(durable: DjangoDurable, timeout: float) -> bool:
    """Flush one Durable's publisher, then dispose of its pool whatever the flush says (an
    unsent message is flagged for the relay on the database: the flush comes first)."""
    try:
        flushed = durable.flush(timeout=timeout)
        if not flushed:
            log.warning(
                "durable: messages of %r still unsent after %ss: a late one may reopen a connection",
                durable,
                timeout,
            )
        return flushed
    finally:
        durable.db.dispose()


class DurableTransactionTestCase(TransactionTestCase):
    """A ``TransactionTestCase`` that closes durable's connections after each test and class."""

    durable_alias: str = DEFAULT_ALIAS

    @property
    def durable(self) -> DjangoDurable:
        """The DjangoDurable of ``durable_alias`` (``durable_for``)."""
        return durable_for(self.durable_alias)

    @classmethod
    def setUpClass(cls) -> None:
        """Django's set-up, then this session's own broker namespace for durable's messages
        (``worker.isolation``): a developer's worker on the same broker never takes them."""
        super().setUpClass()
        isolate_durable(durable_for(cls.durable_alias))

    def _post_teardown(self) -> None:
        """Django's teardown of a test, then ``release_durable_connections()``."""
        try:
            super()._post_teardown()
        finally:
            release_durable_connections()

    @classmethod
    def tearDownClass(cls) -> None:
        """``release_durable_connections()`` (class-level set-up may have used them), then Django's."""
        try:
            release_durable_connections()
        finally:
            super().tearDownClass()
