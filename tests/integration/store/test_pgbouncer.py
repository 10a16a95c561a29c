"""Behind PgBouncer in transaction mode: no session state, no server-side prepared statements.

A real pgbouncer process (Debian's package; `.ci/run` installs it and requires it) pools the test database in
transaction mode with a small pool; runs, keys, waits and children all work through it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from durable_celery import Durable, current_run
from durable_celery.testing import wait_for, worker
from tests.conftest import FAST, REDIS_URL

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def bouncer_url(pg_url: str) -> Iterator[str]:
    tmp_path = Path(tempfile.mkdtemp(prefix="durable-pgbouncer-"))  # readable by its own user
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.path.exists(binary):
        # CI installs it and sets DURABLE_REQUIRE_PGBOUNCER, so there a missing one fails.
        if os.environ.get("DURABLE_REQUIRE_PGBOUNCER"):
            pytest.fail("pgbouncer is not installed (apt-get install pgbouncer)")
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    port = _free_port()
    (tmp_path / "users.txt").write_text('"postgres" ""\n')
    config = tmp_path / "pgbouncer.ini"
    config.write_text(
        "\n".join(
            [
                "[databases]",
                "* = host=127.0.0.1 port=5432",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {tmp_path / 'users.txt'}",
                "pool_mode = transaction",
                "default_pool_size = 3",
                "max_client_conn = 100",
                "ignore_startup_parameters = extra_float_digits,options",
            ]
        )
        + "\n"
    )
    os.chmod(tmp_path, 0o755)
    for path in tmp_path.iterdir():
        os.chmod(path, 0o666)
    cmd = [binary, str(config)]
    if os.geteuid() == 0:
        cmd[1:1] = ["-u", "postgres"]  # pgbouncer refuses to run as root
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "pgbouncer died"
            assert time.monotonic() < deadline, "pgbouncer did not start"
            time.sleep(0.1)
    yield pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{port}")
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_runs_keys_waits_and_children_work_through_a_transaction_mode_pgbouncer(bouncer_url, redis_client):
    app = Celery("bounced", broker=REDIS_URL)
    app.conf.task_default_queue = "q-bounced"
    durable = Durable(app, bouncer_url, pgbouncer=True, pool_size=4, **FAST)
    child = durable.workflow("child")

    @child.step
    def double(n):
        return n * 2

    wf = durable.workflow("bounced", key="b:{n}")

    @wf.step(retry=2)
    def first(n):
        if current_run().attempt == 1:
            raise ConnectionError("once")
        current_run().context["twice"] = current_run().call_workflow(child, {"n": n})

    @wf.step
    def second(n):
        current_run().sleep(0.2)
        return current_run().context["twice"]

    with worker(durable, concurrency=4):
        ids = [durable.start(wf, {"n": n}) for n in range(12)]  # more runs than pooled servers
        assert durable.start(wf, {"n": 3}) == ids[3]  # a duplicate, answered by the holder
        # Without a key: its INSERT goes in pipeline mode, the message sent before the Sync.
        loose = [durable.start(child, {"n": n}) for n in range(8)]
        runs = [wait_for(durable, run_id, timeout=60) for run_id in ids]
        assert [wait_for(durable, run_id, timeout=60).output for run_id in loose] == [n * 2 for n in range(8)]
    assert [r.output for r in runs] == [n * 2 for n in range(12)]
    assert all(r.status == "completed" for r in runs)
    durable.db.dispose()


def test_atomic_steps_write_once_through_a_transaction_mode_pgbouncer(bouncer_url, redis_client):
    """Issue 40: an atomic step is one transaction on one server connection, which transaction
    mode keeps for it: its writes and durable's record commit together, a failed try's roll back."""
    from sqlalchemy import text

    app = Celery("bounced_atomic", broker=REDIS_URL)
    app.conf.task_default_queue = "q-bounced-atomic"
    durable = Durable(app, bouncer_url, pgbouncer=True, pool_size=4, **FAST)
    with durable.db.begin() as conn:
        conn.execute(text("CREATE TABLE bounced_ledger (run_id text, n int)"))
    wf = durable.workflow("bounced_atomic")

    @wf.step(atomic=True, retry=2)
    def book(n):
        conn = current_run().connection
        conn.execute(text("INSERT INTO bounced_ledger VALUES (:id, :n)"), {"id": current_run().id, "n": n})
        if current_run().attempt == 1 and n % 2:
            raise ConnectionError("once")  # its insert is rolled back

    with worker(durable, concurrency=4):
        ids = [durable.start(wf, {"n": n}) for n in range(12)]  # more runs than pooled servers
        assert [durable.result(run_id, timeout=60) for run_id in ids] == [None] * 12  # answers too
    with durable.db.engine.connect() as conn:
        rows = conn.execute(text("SELECT run_id, n FROM bounced_ledger ORDER BY n")).all()
    assert [tuple(r) for r in rows] == [(run_id, n) for n, run_id in enumerate(ids)]
    durable.db.dispose()
