"""A missing optional dependency is named with the command that installs it: for a package
installed from an index, and (with the editable form too) for a source checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "from durable_celery.errors import MissingExtra; print(MissingExtra('web', 'the dashboard'))"


def _said(path: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"},
        cwd=path,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_from_a_checkout_the_hint_gives_both_forms():
    assert _said(ROOT) == (
        "the dashboard needs the web extra: pip install 'durable-celery[web]' "
        "(in this checkout: pip install -e '.[web]')"
    )


def test_from_an_installed_package_the_hint_names_the_published_package(tmp_path):
    shutil.copytree(
        ROOT / "durable_celery", tmp_path / "durable_celery", ignore=shutil.ignore_patterns("__pycache__")
    )
    assert _said(tmp_path) == "the dashboard needs the web extra: pip install 'durable-celery[web]'"


@pytest.mark.parametrize("extra", ["metrics", "web"])
def test_every_extra_a_hint_may_name_exists(extra):
    from importlib.metadata import metadata  # what the installed package offers (tomllib needs 3.11)

    assert extra in metadata("durable-celery").get_all("Provides-Extra")
