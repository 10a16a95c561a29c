"""The example programs of examples/: each one's whole output is the block in examples/README.md.

Every program runs as `python -m examples.NAME` from the repository root, in an environment
with no server address, and must exit 0, print exactly its README block and leave no file
behind in the checkout. Most need no servers: the in-memory store and Celery's memory://
broker, or the testing Fake. Those in NEEDS_POSTGRES (atomic steps) are given a fresh database
of their own by DURABLE_DATABASE_URL, dropped afterwards.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.conftest import PG_HOST, _admin
from tests.e2e.test_examples import ROOT, clean_env

EXAMPLES = ROOT / "examples"
README = EXAMPLES / "README.md"
NOT_PROGRAMS = {"__init__", "shop"}  # shop.py is an app for `celery worker` (test_examples.py)
NEEDS_POSTGRES = {"ledger"}  # atomic steps: PostgreSQL only

# A README section's command (after the variables it is given, if any) and, after it, the
# program's whole output.
BLOCK = re.compile(
    r"```sh\n(?:[A-Z_]+=\S+ )*python -m examples\.(?P<name>\w+)\n```\s*\n```text\n(?P<output>.*?)```",
    re.DOTALL,
)


def readme_blocks() -> dict[str, str]:
    """{example name: expected output} from examples/README.md."""
    blocks: dict[str, str] = {}
    for match in BLOCK.finditer(README.read_text()):
        assert match["name"] not in blocks, f"two blocks for {match['name']} in examples/README.md"
        blocks[match["name"]] = match["output"]
    return blocks


def example_programs() -> list[str]:
    return sorted(path.stem for path in EXAMPLES.glob("*.py") if path.stem not in NOT_PROGRAMS)


def files_written_to() -> set[str]:
    """What a program could leave behind: the repository root's entries (a `.durable/` folder,
    a SQLite file, a log) and every file under examples/, byte-code caches left out."""
    found = {entry.name for entry in ROOT.iterdir()}
    found |= {str(path.relative_to(ROOT)) for path in EXAMPLES.rglob("*") if "__pycache__" not in path.parts}
    return found


def test_every_example_program_has_its_output_in_the_readme() -> None:
    blocks = readme_blocks()
    missing = [name for name in example_programs() if name not in blocks]
    assert not missing, f"examples/README.md has no output block for: {', '.join(missing)}"
    stale = [name for name in blocks if not (EXAMPLES / f"{name}.py").exists()]
    assert not stale, f"examples/README.md has blocks for missing programs: {', '.join(stale)}"


@contextmanager
def servers_for(name: str) -> Iterator[dict[str, str]]:
    """The server addresses program ``name`` is given: none, or for one in NEEDS_POSTGRES a
    database of its own (made empty here, dropped afterwards) as DURABLE_DATABASE_URL."""
    if name not in NEEDS_POSTGRES:
        yield {}
        return
    database = f"durable_example_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f"CREATE DATABASE {database}")
    try:
        yield {"DURABLE_DATABASE_URL": f"{PG_HOST}/{database}"}
    finally:
        with _admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


def _programs_with_marks() -> list[object]:
    return [
        pytest.param(name, marks=[pytest.mark.postgres] if name in NEEDS_POSTGRES else [])
        for name in sorted(set(readme_blocks()) - NOT_PROGRAMS)
    ]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", _programs_with_marks())
def test_example_prints_exactly_its_readme_block(name: str) -> None:
    expected = readme_blocks()[name]
    before = files_written_to()
    with servers_for(name) as servers:
        done = subprocess.run(
            [sys.executable, "-m", f"examples.{name}"],
            cwd=ROOT,
            env=clean_env(**servers),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, f"python -m examples.{name} exited {done.returncode}:\n{done.stderr}"
    if done.stdout != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                done.stdout.splitlines(keepends=True),
                f"examples/README.md ({name})",
                f"python -m examples.{name}",
            )
        )
        pytest.fail(f"the output of examples/{name}.py changed:\n{diff}\nstderr:\n{done.stderr}")
    written = files_written_to() - before  # only new paths: others may edit files meanwhile
    assert not written, f"python -m examples.{name} wrote into the checkout: {sorted(written)}"
