"""Hypothesis profiles of the model suite, and a harness per test on each backend.

``ci`` (the default) is sized so the whole model suite runs in a minute or two on a 2-core CI
machine; ``long`` (``pytest tests/model --hypothesis-profile=long``) runs many more examples.
The profiles are registered in tests/conftest.py, which pytest imports before it reads
``--hypothesis-profile``, whatever the command line names.
"""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import settings

from durable_celery.testing import RecordingOutbox


@pytest.fixture
def model_settings(request: pytest.FixtureRequest) -> settings:
    """The profile chosen with ``--hypothesis-profile``, else ``ci``."""
    name = request.config.getoption("hypothesis_profile", None) or "ci"
    return settings.get_profile(name)


@pytest.fixture(params=["postgres", "sqlite", "fake"])
def backend(request: pytest.FixtureRequest) -> str:
    """The model runs against both backends and testing.Fake, so the Fake cannot drift either."""
    return str(request.param)


@pytest.fixture
def harness(make_durable):
    """A Harness on this test's backend: one Durable per test, tables cleared per example."""
    from tests.model.test_key_model import Harness

    # Heartbeats far apart: a step never sees a cancel before it returns (the test cancels
    # from inside steps, then checks; a heartbeat would stop the step mid-check).
    # Messages are recorded by the outbox, not sent: steps run through run_message here.
    settings = {
        "heartbeat_interval": 30.0,
        "stale_lock_timeout": 120.0,
        "prune": Harness.PRUNE,
        "publish_in_background": False,
    }
    durable = make_durable(broker_url="memory://", upkeep=False, outbox=RecordingOutbox(), **settings)
    if durable.db.is_postgres:  # this test's own database: commits need not wait for the disk
        with psycopg.connect(durable.db.url.replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute("ALTER DATABASE " + conn.info.dbname + " SET synchronous_commit = off")
        durable.db.dispose()
    harness = Harness(durable)
    yield harness
    harness.close()
