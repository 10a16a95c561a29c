"""The example programs of examples/: each one's whole output is the block in examples/README.md.

Every program runs as `python -m examples.NAME` from the repository root, in an environment
with no server address, and must exit 0, print exactly its README block and leave no file
behind in the checkout. They need no servers: the in-memory store and Celery's memory://
broker, or the testing Fake.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys

import pytest

from tests.e2e.test_examples import ROOT, clean_env

EXAMPLES = ROOT / "examples"
README = EXAMPLES / "README.md"
NOT_PROGRAMS = {"__init__", "shop"}  # shop.py is an app for `celery worker` (test_examples.py)

# A README section's command and, after it, the program's whole output.
BLOCK = re.compile(
    r"```sh\npython -m examples\.(?P<name>\w+)\n```\s*\n```text\n(?P<output>.*?)```", re.DOTALL
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


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", sorted(set(readme_blocks()) - NOT_PROGRAMS))
def test_example_prints_exactly_its_readme_block(name: str) -> None:
    expected = readme_blocks()[name]
    before = files_written_to()
    done = subprocess.run(
        [sys.executable, "-m", f"examples.{name}"],
        cwd=ROOT,
        env=clean_env(),
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
