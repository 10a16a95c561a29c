"""MkDocs hooks of the documentation site (mkdocs.yml): pages that show a file of the repository's
root, README's settings table and CHANGELOG.md, kept in one place."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

# page -> (its line that links to the text in the repository, the file, the section's heading
# or None for the whole file). On the site the line is replaced by that text.
INCLUDES = {
    "reference/settings.md": (
        "[The settings table of the README](../../README.md#settings)",
        "README.md",
        "## Settings",
    ),
    "changelog.md": ("[CHANGELOG.md](../CHANGELOG.md)", "CHANGELOG.md", None),
}


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    """On a page of ``INCLUDES``, replace its link line with the text it links to."""
    if page.file.src_uri not in INCLUDES:
        return markdown
    line, name, heading = INCLUDES[page.file.src_uri]
    if line not in markdown:
        raise PluginError(f"{page.file.src_uri} lost its line {line!r}")
    path = Path(config.config_file_path).parent / name
    if not path.is_file():
        return markdown.replace(line, f"`{name}` is not in this checkout.")
    text = path.read_text(encoding="utf-8")
    if heading is not None:
        found = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
        if found is None:
            raise PluginError(f"{name} has no {heading!r} section for {page.file.src_uri}")
        text = found.group(1)
    # Links written from the root (docs/keys.md) as seen from the page (keys.md, ../keys.md).
    up = "../" * page.file.src_uri.count("/")
    return markdown.replace(line, text.strip().replace("](docs/", f"]({up}"))
