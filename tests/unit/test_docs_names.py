"""The names the docs give exist in the code: every Prometheus metric (against what
``observe/metrics.py`` registers), every setting (``app.conf.durable_<name>``,
``CELERY_DURABLE_<NAME>``, ``Durable(app, <name>=...)``, a table of settings; against
``Settings``' fields) and every ``celery -A app durable <command> --flag`` (against the click
commands of ``durable_celery.cli``).

The docs are README.md and every Markdown file under docs/, except the changelogs: they name
what was removed or renamed, on purpose. No servers: the metrics come from a ``testing.Fake``.
"""

from __future__ import annotations

import ast
import inspect
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path

import click
import pytest

import durable_celery
from durable_celery import Durable, pytest_plugin
from durable_celery import signals as durable_signals
from durable_celery.cli import durable as durable_group
from durable_celery.observe.metrics import DatabaseRows
from durable_celery.settings import Settings
from durable_celery.store.schema import VERSION_TABLE, metadata
from durable_celery.testing import Fake

ROOT = Path(__file__).resolve().parents[2]
# Changelogs name removed and renamed things on purpose (docs/changelog.md includes CHANGELOG.md).
NOT_CHECKED = {ROOT / "CHANGELOG.md", ROOT / "docs" / "changelog.md"}
DOCS = sorted(p for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")] if p not in NOT_CHECKED)

# The names a metric family's samples take in a scrape (a gauge's is its own).
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("", "_bucket", "_sum", "_count", "_created"),
}
# A name ending so is a metric as Prometheus shows it (a unit, or a sample's suffix).
METRIC_SUFFIX = re.compile(r"_(total|seconds|bytes|bucket|count|sum|created|info)$")
# A line about metrics: a durable_ name on it that is no table, signal or setting is a metric.
METRIC_WORDS = re.compile(r"\b(gauges?|counters?|histograms?|metrics?|prometheus|scraped?)\b", re.I)
# durable_<word>, not part of a longer name or of a path (durable_celery.observe, durable_runs.id).
DURABLE_NAME = re.compile(r"(?<![\w./-])durable_[a-z0-9_]*[a-z0-9](?![\w/-]|\.\w)")
CONF_SETTING = re.compile(r"\bconf\.durable_([a-z0-9_]+)\b")
DJANGO_SETTING = re.compile(r"\bCELERY_DURABLE_([A-Z0-9_]+)\b")
# The durable command group after ``celery -A app``, or opening a code span of its own.
CLI = re.compile(
    r"(?:\bcelery\s+(?:-A\s*|--app[=\s])\S+\s+durable(?![\w.])|^\s*(?:\$\s+)?durable(?=\s+-*[a-z]))"
    r"(?P<rest>(?:\s+\S+)*)"
)
OPTION = re.compile(r"\[?(--?[A-Za-z][\w-]*)(?:=\S*)?\]?[,.)]?")  # --fix, [--fix], --port=9808
SHELL_END = {"|", "||", "&&", ";", ">", "2>&1"}


# -- what the code has -------------------------------------------------------------------------


def registered_metrics() -> set[str]:
    """Every name a scrape of ``durable.metrics`` can show: gauges as they are, counters with
    ``_total``, histograms by their own name and with ``_bucket``, ``_sum``, ``_count``."""
    fake = Fake()
    try:
        metrics = fake.metrics
        # Every database gauge without reading a database, the schedules' lateness included
        # (a real read leaves it out when it cannot reach RedBeat).
        metrics.collector._read = lambda: DatabaseRows(  # type: ignore[method-assign]
            ready=(), unfinished=(), recent=(), stale=0, disabled=0, late=0
        )
        names = set()
        for family in metrics.registry.collect():
            names.update(family.name + suffix for suffix in SAMPLE_SUFFIXES.get(family.type, ("",)))
        return names
    finally:
        fake.close()


def settings_known() -> set[str]:
    """Settings' fields, and the settings ``contrib.django`` reads itself: from the app's
    configuration (``conf.get("durable_<name>")``) or Django's (``getattr(settings,
    "CELERY_DURABLE_<NAME>")``)."""
    known = {f.name for f in fields(Settings)}
    for path in (ROOT / "durable_celery" / "contrib" / "django").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            texts = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                known.update(t.removeprefix("durable_") for t in texts[:1] if t.startswith("durable_"))
            if isinstance(node.func, ast.Name) and node.func.id == "getattr":
                prefix = "CELERY_DURABLE_"
                known.update(t.removeprefix(prefix).lower() for t in texts if t.startswith(prefix))
    return known


def other_durable_names() -> set[str]:
    """durable_ names the code gives to other things than metrics: tables, signals, pytest
    fixtures and other Python names, the settings' ``app.conf`` keys."""
    tables = {*metadata.tables, VERSION_TABLE}
    signals = {getattr(durable_signals, name).name for name in durable_signals.__all__}
    python = {n for m in (durable_celery, pytest_plugin) for n in dir(m) if n.startswith("durable_")}
    conf = {f"durable_{name}" for name in settings_known()}
    return tables | signals | python | conf | {"durable_celery"}


def durable_keywords() -> set[str]:
    """What ``Durable(app, ...)`` takes by name: its own parameters and every setting."""
    parameters = inspect.signature(Durable.__init__).parameters.values()
    return {p.name for p in parameters if p.kind != p.VAR_KEYWORD} | {f.name for f in fields(Settings)}


def cli_options(command: click.Command) -> set[str]:
    """Every spelling of every option of ``command`` (``--status``, ``-s``)."""
    return {o for p in command.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}


# -- the code in the docs ----------------------------------------------------------------------


def code(text: str) -> Iterator[tuple[int, str]]:
    """(line number, code): each fenced block whole, each inline code span elsewhere."""
    block: list[str] = []
    fence, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"\s*(```|~~~)", line)
        if fence and opening and opening.group(1) == fence:
            yield start, "\n".join(block)
            fence, block = "", []
        elif fence:
            block.append(line)
        elif opening:
            fence, start = opening.group(1), number + 1
        else:
            for _, span in re.findall(r"(`+)(.+?)\1", line):
                yield number, span.strip()


def code_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, code) for each line of the code in ``text``, shell comments cut off."""
    for start, found in code(text):
        for offset, line in enumerate(found.splitlines()):
            yield start + offset, re.sub(r"(^|\s)#.*", "", line)


def durable_call_keywords(text: str) -> Iterator[tuple[int, str]]:
    """(line number, name) of each keyword argument of a ``Durable(...)`` call in the code."""
    for start, found in code(text):
        for call in re.finditer(r"(?<![\w.])Durable\(", found):
            for index, name in _keywords(found, call.end()):
                yield start + found.count("\n", 0, index), name


def _keywords(source: str, i: int) -> Iterator[tuple[int, str]]:
    """The keyword arguments of the call whose ``(`` ends at ``i``, to its ``)`` or the end of
    ``source``; strings and nested brackets skipped."""
    depth, argument_start = 1, i
    while i < len(source) and depth:
        char = source[i]
        if char in "\"'":
            end = source.find(char, i + 1)
            i = len(source) if end < 0 else end
        elif char in "([{" or char in ")]}":
            depth += 1 if char in "([{" else -1
        elif char == "," and depth == 1:
            argument_start = i + 1
        elif char == "=" and depth == 1 and source[i + 1 : i + 2] != "=":
            name = re.fullmatch(r"\s*(\w+)\s*", source[argument_start:i])
            if name is not None:
                yield i, name.group(1)
        i += 1


def settings_table_names(text: str) -> Iterator[tuple[int, str]]:
    """(line number, name) of each row of a Markdown table whose first column is ``setting``."""
    in_table = False
    for number, line in enumerate(text.splitlines(), 1):
        first = line.strip().strip("|").split("|")[0].strip() if line.startswith("|") else None
        if first is None:
            in_table = False
        elif first == "setting":
            in_table = True
        elif in_table and not set(first) <= set("-: "):
            yield number, first.strip("`")


# -- the checks --------------------------------------------------------------------------------


def metric_problems(text: str, metrics: set[str], others: set[str]) -> list[str]:
    """Names that look like metrics (a Prometheus suffix, or named on a line about metrics and
    no other thing of ours) but that ``durable.metrics`` does not have."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        about_metrics = METRIC_WORDS.search(line) is not None
        for name in DURABLE_NAME.findall(line):
            if name not in metrics and (METRIC_SUFFIX.search(name) or (about_metrics and name not in others)):
                problems.append(f"{number}: {name} is not a metric")
    return problems


def setting_problems(text: str, known: set[str], keywords: set[str]) -> list[str]:
    """``conf.durable_<name>``, ``CELERY_DURABLE_<NAME>``, ``Durable(..., <name>=)`` and rows of
    a table of settings that name no setting."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for name in CONF_SETTING.findall(line):
            if name not in known:
                problems.append(f"{number}: conf.durable_{name} is not a setting")
        for name in DJANGO_SETTING.findall(line):
            if name.lower() not in known:
                problems.append(f"{number}: CELERY_DURABLE_{name} is not a setting")
    for number, name in durable_call_keywords(text):
        if name not in keywords:
            problems.append(f"{number}: Durable(..., {name}=...) is not a setting")
    for number, name in settings_table_names(text):
        if name not in known:
            problems.append(f"{number}: {name}, in a table of settings, is not a setting")
    return problems


def cli_problems(text: str, group: click.Group) -> list[str]:
    """``celery -A app durable <command> --flag`` (or ``durable <command> ...`` opening a code
    span) naming a command or an option the CLI does not have."""
    problems = []
    for number, line in code_lines(text):
        for found in CLI.finditer(line):
            words = [w.strip("`") for w in _shell_words(found.group("rest"))]
            problems += [f"{number}: durable {o}: no such option" for o in _options(words, group)]
            if words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
                problems += _command_problems(number, words, group)
    return problems


def _command_problems(number: int, words: list[str], group: click.Group) -> list[str]:
    name = words.pop(0)
    command = group.commands.get(name)
    if command is None:
        return [f"{number}: durable {name}: no such command"]
    return [f"{number}: durable {name} {o}: no such option" for o in _options(words, command)]


def _shell_words(text: str) -> list[str]:
    """Words as the shell splits them (``"$(openssl rand -hex 16)"`` is one), else by spaces."""
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote: prose, not a command line
        return text.split()


def _options(words: list[str], command: click.Command) -> list[str]:
    """The options among ``words`` that ``command`` lacks, taking the words up to the end of the
    shell command; for a group, only the options before its command's name."""
    lacking = []
    while words and words[0] not in SHELL_END:
        option = OPTION.fullmatch(words[0])
        if option is None and isinstance(command, click.Group):
            return lacking  # the command's name
        words.pop(0)
        if option is not None and option.group(1) not in cli_options(command):
            lacking.append(option.group(1))
    words.clear()
    return lacking


# -- the tests ---------------------------------------------------------------------------------


def in_the_docs(check: Callable[..., list[str]], *args: object) -> list[str]:
    """``check`` run on every doc: its problems as ``path:line: what``."""
    found = []
    for path in DOCS:
        problems = check(path.read_text(encoding="utf-8"), *args)
        found += [f"{path.relative_to(ROOT).as_posix()}:{p}" for p in problems]
    return found


@pytest.fixture(scope="module")
def metrics() -> set[str]:
    return registered_metrics()


def test_the_docs_are_read_but_not_the_changelogs() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/watching.md", "docs/django.md", "docs/reference/signals.md"} <= names
    assert not names & {"CHANGELOG.md", "docs/changelog.md"}


def test_every_metric_the_docs_name_is_registered(metrics: set[str]) -> None:
    assert {"durable_oldest_ready_run_age_seconds", "durable_ack_failed_total"} <= metrics
    assert in_the_docs(metric_problems, metrics, other_durable_names()) == []


def test_every_setting_the_docs_name_exists() -> None:
    assert in_the_docs(setting_problems, settings_known(), durable_keywords()) == []


def test_every_command_and_option_the_docs_name_exists() -> None:
    assert in_the_docs(cli_problems, durable_group) == []


# -- the checks find what is wrong -------------------------------------------------------------


def test_a_wrong_metric_name_is_found(metrics: set[str]) -> None:
    text = (
        "| `durable_oldest_ready_seconds` | gauge | |\n"  # a Prometheus suffix
        "the `durable_nodes_drainig` gauge counts it\n"  # on a line about metrics
        "rows of `durable_runs` and `durable_nodes`, the `durable_run_finished` signal: no metrics\n"
        "`durable_ready_runs`, `durable_ack_failed_total`, `durable_db_pool_wait_seconds_bucket`\n"
    )
    assert metric_problems(text, metrics, other_durable_names()) == [
        "1: durable_oldest_ready_seconds is not a metric",
        "2: durable_nodes_drainig is not a metric",
    ]


def test_a_wrong_setting_is_found() -> None:
    text = (
        "app.conf.durable_pool_size = 5; app.conf.durable_pool_sise = 5\n"
        "CELERY_DURABLE_RELAY_AFTER = 60\nCELERY_DURABLE_JOIN_ATOMIC = True\nCELERY_DURABLE_RELAY = 60\n"
        "```python\n"
        'Durable(app, "postgresql://db/app?gssencmode=disable", metrics_port=9808,\n'
        "        outbox=RecordingOutbox(accept=f), metric_port=1)\n"
        "```\n"
        "| setting | default |\n|---|---|\n| `pool_size` | `5` |\n| `poolsize` | `5` |\n"
        "\n| `poolsize` | not a table of settings |\n"
    )
    assert setting_problems(text, settings_known(), durable_keywords()) == [
        "1: conf.durable_pool_sise is not a setting",
        "4: CELERY_DURABLE_RELAY is not a setting",
        "7: Durable(..., metric_port=...) is not a setting",
        "12: poolsize, in a table of settings, is not a setting",
    ]


def test_a_wrong_command_or_option_is_found() -> None:
    text = (
        "```sh\n"
        "celery -A app durable doctor --fix --json   # --not-checked in a comment\n"
        "celery -A proj durable --traceback runs -w x -n 5\n"
        'celery -A app durable web --token "$(openssl rand -hex 16)"\n'
        "celery -A app durable doctor --repair\n"
        "celery -A app durable fix-all --now | tee out.txt --not-ours\n"
        "celery -A app durable --trace runs\n"
        "```\n"
        "run `celery -A app durable cleanup --older-than 30d [--status S ...] [--dry-run]`,"
        " or `durable metrics --adress 0.0.0.0`; `durable upkeep: relay_once works again`\n"
    )
    assert cli_problems(text, durable_group) == [
        "5: durable doctor --repair: no such option",
        "6: durable fix-all: no such command",
        "7: durable --trace: no such option",
        "9: durable metrics --adress: no such option",
    ]
