"""The documentation site (mkdocs.yml over docs/): it builds with ``mkdocs build --strict`` (a
broken link, anchor or docstring reference fails), its API reference covers every name
``durable_celery`` exports, and the home page starts with README's first two commands."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import durable_celery

ROOT = Path(__file__).resolve().parents[2]
NEEDED = ["mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"]
MISSING = "mkdocs, mkdocs-material and mkdocstrings[python] are not installed: pip install -e '.[docs]'"


def sh_blocks(path: Path) -> list[str]:
    """The ```sh blocks of a Markdown file, in order."""
    return re.findall(r"^```sh\n(.*?)^```", path.read_text(encoding="utf-8"), re.M | re.S)


def test_home_page_starts_with_readmes_two_commands() -> None:
    readme = sh_blocks(ROOT / "README.md")[:2]
    assert len(readme) == 2
    assert sh_blocks(ROOT / "docs" / "index.md")[:2] == readme


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``mkdocs build --strict`` writes it into a temporary folder."""
    if not all(_installed(name) for name in NEEDED):
        # CI installs the docs extra and sets DURABLE_REQUIRE_DOCS, so there a missing one fails.
        if os.environ.get("DURABLE_REQUIRE_DOCS"):
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return out


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_site_builds_strict_with_every_page(site: Path) -> None:
    pages = {p.relative_to(ROOT / "docs").with_suffix("").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    for page in pages:
        html = site / ("index.html" if page == "index" else f"{page.removesuffix('/index')}/index.html")
        assert html.is_file(), page


def test_reference_documents_every_public_name(site: Path) -> None:
    ids = set()
    for html in (site / "reference").rglob("*.html"):
        ids.update(re.findall(r'id="(durable_celery\.[\w.]+)"', html.read_text(encoding="utf-8")))
    missing = [n for n in durable_celery.__all__ if not any(i.rsplit(".", 1)[-1] == n for i in ids)]
    assert not missing, f"not in docs/reference/: {missing}"
    for name in ["durable_celery.signals.run_finished", "durable_celery.beat.DurableScheduler"]:
        assert name in ids
    assert "durable_celery.contrib.django.durable.DjangoDurable" in ids
    assert "durable_celery.testing.Fake" in ids


def test_settings_page_shows_readmes_table(site: Path) -> None:
    page = (site / "reference" / "settings" / "index.html").read_text(encoding="utf-8")
    for name in ["stale_lock_timeout", "relay_after", "inline_steps", "max_input_bytes"]:
        assert f"<code>{name}</code>" in page


def test_changelog_page_includes_changelog(site: Path) -> None:
    page = (site / "changelog" / "index.html").read_text(encoding="utf-8")
    changelog = ROOT / "CHANGELOG.md"
    if not changelog.is_file():
        assert "is not in this checkout" in page
        return
    headings = re.findall(r"^## \[?([^\]\s]+)", changelog.read_text(encoding="utf-8"), re.M)
    assert headings
    for version in headings:
        assert version in page
