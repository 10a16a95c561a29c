"""The release a user installs: tests/release/check_wheel.sh builds the wheel and the sdist,
checks them with twine, installs the wheel into a fresh venv from the index and uses it from an
empty folder (the demo, the CLI, migrate, the dashboard)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("check_wheel.sh")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_wheel_installs_and_works_outside_the_checkout() -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "== the release checks passed" in done.stdout
