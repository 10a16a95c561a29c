"""The pytest plugin as a user's project sees it: its fixtures, loaded by entry point or by name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

USERS_TESTS = textwrap.dedent(
    """
    from durable_celery import Durable, current_run
    from durable_celery.testing import wait_for


    def checkout(durable: Durable, order: str) -> str:
        return durable.start("charge", {"order": order}, key=f"order:{order}")


    def define(durable):
        @durable.workflow(name="charge")
        def charge(order):
            current_run().sleep(60)
            return f"charged {order}"


    def test_with_the_fake(durable_fake):
        define(durable_fake)
        run_id = checkout(durable_fake, "A1")
        assert checkout(durable_fake, "A1") == run_id
        durable_fake.run_until_idle()
        assert durable_fake.get_run(run_id).status == "waiting"
        durable_fake.advance(60)
        durable_fake.run_until_idle()
        assert durable_fake.get_run(run_id).output == "charged A1"


    def test_with_a_memory_store_and_a_worker_thread(durable_memory):
        @durable_memory.workflow(name="quick")
        def quick(n):
            return n + 1

        assert wait_for(durable_memory, durable_memory.start("quick", {"n": 1}), timeout=20).output == 2


    def test_durable_worker_starts_a_worker_for_any_durable(durable_worker):
        from celery import Celery

        durable = Durable(Celery("mine", broker="memory://localhost/"), "memory://")

        @durable.workflow(name="mine")
        def mine():
            return "ran"

        durable_worker(durable, concurrency=1)
        assert wait_for(durable, durable.start("mine"), timeout=20).output == "ran"
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("load", ["entry point", "-p", "pytest_plugins"])
def test_users_tests_get_the_fixtures_and_nothing_is_written_to_their_folder(tmp_path, load):
    (tmp_path / "test_users.py").write_text(USERS_TESTS)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DURABLE_", "CELERY_"))},
        "PYTHONPATH": str(ROOT),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    # (pytest-benchmark, where installed, writes a .benchmarks folder of its own: kept off)
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:benchmark",
        "test_users.py",
    ]
    if load == "-p":  # a project that turns plugin autoloading off names it
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        args[3:3] = ["-p", "durable_celery.pytest_plugin"]
    if load == "pytest_plugins":  # or lists it in its conftest.py
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        (tmp_path / "conftest.py").write_text('pytest_plugins = ["durable_celery.pytest_plugin"]\n')
    before = sorted(os.listdir(tmp_path))
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout
    assert sorted(os.listdir(tmp_path)) == before  # nothing written beside the user's files


def test_without_the_plugin_the_fixtures_are_not_there(tmp_path):
    (tmp_path / "test_users.py").write_text("def test_x(durable_fake):\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_users.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "fixture 'durable_fake' not found" in done.stdout
