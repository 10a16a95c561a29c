"""The equivalent mutants listed in equivalent.md: a survivor of the named function whose changed
lines match an entry is not counted against its module's score.

An entry's heading is ``### module.py: function: what`` (``function`` as ``name`` or
``Class.method``), then why, then a ```diff block; ``### module.py: function (every mutant)``
without a diff block covers every mutant of a function nothing calls."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

LIST = Path(__file__).with_name("equivalent.md")
HEADING = re.compile(r"^### (?P<path>\S+\.py): (?P<title>.+)$", re.MULTILINE)
EVERY = re.compile(r"^`?(?P<function>[\w.]+)`? \(every mutant\)$")
FUNCTION = re.compile(r"^`?(?P<function>[\w.]+)`?: ")
DIFF = re.compile(r"^```diff\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Equivalent:
    """One listed mutant: its module, the lines it removes and adds, and why it changes nothing."""

    path: str
    title: str
    reason: str
    removed: tuple[str, ...]
    added: tuple[str, ...]
    function: str  # ``name`` or ``Class.method``
    every: bool = False  # every mutant of the function

    def covers(self, path: str, mutant: str, removed: tuple[str, ...], added: tuple[str, ...]) -> bool:
        """Is this mutant (its module, mutmut name and changed lines) the one listed?"""
        if path != self.path or not re.search(rf"{mangled(self.function)}__mutmut_\d+$", mutant):
            return False
        return self.every or (removed, added) == (self.removed, self.added)


def mangled(function: str) -> str:
    """How mutmut names a function in its mutants' names (a pattern)."""
    if "." in function:
        cls, name = function.split(".", 1)
        return re.escape(f"x\u01c1{cls}\u01c1{name}")
    return re.escape(f"x_{function}")


def _entry(path: str, title: str, body: str) -> Equivalent:
    diff = DIFF.search(body)
    prose = body[: diff.start()] if diff else body
    reason = " ".join(line.strip() for line in prose.splitlines() if line.strip())
    lines = diff["body"].splitlines() if diff else []
    removed = tuple(line[1:].strip() for line in lines if line.startswith("-"))
    added = tuple(line[1:].strip() for line in lines if line.startswith("+"))
    every = EVERY.match(title)
    named = every or FUNCTION.match(title)
    if named is None:
        raise ValueError(f"equivalent.md: {title!r} names no function (### path: function: what)")
    return Equivalent(path, title, reason, removed, added, named["function"], every is not None)


def load_equivalents(path: Path = LIST) -> list[Equivalent]:
    """Every entry: a ``### module.py: what`` heading, a line of reason, a ```diff block."""
    if not path.exists():
        return []
    text = path.read_text()
    headings = list(HEADING.finditer(text))
    entries = []
    for n, heading in enumerate(headings):
        end = headings[n + 1].start() if n + 1 < len(headings) else len(text)
        body = text[heading.end() : end].split("\n## ", 1)[0]
        entries.append(_entry(heading["path"], heading["title"], body))
    return entries
