"""Run mutmut 3 over core modules in a private copy of the repository, and report per module.

The shared working tree is never written to: the files git knows (tracked, and untracked ones
not ignored) are copied into a temporary directory, mutmut mutates and tests there, and the copy
is removed afterwards (``--keep`` keeps it). Tests run against a Redis server of the run's own;
every PostgreSQL database a mutant's session creates is dropped at the end, also when a timeout
stopped that session before its teardown.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .equivalent import Equivalent, load_equivalents
from .targets import TARGETS, Target

REPO = Path(__file__).resolve().parents[2]
PG_HOST = os.environ.get("DURABLE_TEST_PG", "postgresql://postgres@127.0.0.1:5432")

# mutmut's exit codes, as its stats module names them.
STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    33: "no tests",
    5: "no tests",
    36: "timeout",
    -24: "timeout",
    24: "timeout",
    152: "timeout",
    255: "timeout",
    37: "caught by type check",
    None: "not checked",
}

# Lines whose mutants say nothing about behaviour: log lines (their text is for people, and
# the lines around them are mutated as usual).
DO_NOT_MUTATE = [r"^\s*log\.(debug|info|warning|error|exception|critical)\("]

MUTMUT = "import sys; from mutmut.__main__ import cli; sys.argv[0] = 'mutmut'; sys.exit(cli())"


@dataclass
class ModuleResult:
    """One module's mutants by outcome, and the diffs of those left alive."""

    target: Target
    statuses: dict[str, str] = field(default_factory=dict)  # mutant name -> status
    diffs: dict[str, str] = field(default_factory=dict)  # survivor name -> diff
    equivalent: dict[str, Equivalent] = field(default_factory=dict)  # survivor name -> entry

    def count(self, status: str) -> int:
        return sum(1 for s in self.statuses.values() if s == status)

    @property
    def alive(self) -> list[str]:
        """Survivors and untested mutants not listed as equivalent."""
        return sorted(
            n for n, s in self.statuses.items() if s in ("survived", "no tests") and n not in self.equivalent
        )

    @property
    def score(self) -> float | None:
        """Killed (timeouts included) over the mutants tested that are not equivalent."""
        total = len(self.statuses) - self.count("not checked") - len(self.equivalent)
        if total <= 0:
            return None
        return (self.count("killed") + self.count("timeout")) / total


def tracked_files(repo: Path) -> list[str]:
    """The files of the working tree git knows: tracked, and untracked but not ignored."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    return sorted({p for p in out.decode().split("\0") if p})


def copy_tree(repo: Path, dest: Path) -> int:
    """Copy the working tree's files into ``dest``; returns how many."""
    count = 0
    for rel in tracked_files(repo):
        source = repo / rel
        if not source.is_file():  # deleted in the working tree, or a submodule
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
        count += 1
    return count


def expand_tests(copy: Path, patterns: Sequence[str]) -> list[str]:
    """Test arguments with their globs expanded in the copy (a glob matching nothing drops)."""
    selected: list[str] = []
    for pattern in patterns:
        path_part = pattern.split("::", 1)[0]
        if any(ch in path_part for ch in "*?["):
            matches = sorted(str(Path(m).relative_to(copy)) for m in glob.glob(str(copy / path_part)))
            selected += [m for m in matches if m not in selected]
        elif (copy / path_part).exists() and pattern not in selected:
            selected.append(pattern)
    return selected


def toml_list(items: Sequence[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def write_config(copy: Path, targets: Sequence[Target], tests: Sequence[str], args: RunOptions) -> None:
    """Append mutmut's settings to the copy's pyproject.toml."""
    pytest_args = ["-p", "tests.mutation.plugin", "-p", "no:cacheprovider", f"--timeout={args.test_timeout}"]
    if args.backend:
        other = "sqlite" if args.backend == "postgres" else "postgres"
        pytest_args += ["-k", f"not {other}"]
    config = f"""

[tool.mutmut]
source_paths = ["durable_celery"]
only_mutate = {toml_list([t.path for t in targets])}
do_not_mutate_patterns = {toml_list(DO_NOT_MUTATE)}
pytest_add_cli_args = {toml_list(pytest_args)}
pytest_add_cli_args_test_selection = {toml_list(tests)}
timeout_multiplier = {args.timeout_multiplier}
timeout_constant = {args.timeout_constant}
use_git_change_detection = false
"""
    with open(copy / "pyproject.toml", "a") as f:
        f.write(config)


def spare_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def private_redis(folder: Path) -> Iterator[str]:
    """A redis-server of this run's own (no persistence), stopped at the end."""
    port = spare_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*args, "--dir", str(folder)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run's redis-server on port {port} did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


TEMPLATE_SCRIPT = """
import sys
from celery import Celery
from durable_celery import Durable
durable = Durable(Celery("template", broker="memory://"), sys.argv[1], upkeep=False)
durable.migrate()
durable.db.dispose()
"""


def make_template(copy: Path, log: Path) -> str:
    """A migrated database every mutant's session clones its test databases from (instead of
    building and migrating one per session); logged, so the clean-up drops it."""
    import psycopg

    name = f"durable_test_template_mut_{os.getpid()}_{int(time.time())}"
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    with open(log, "a") as f:
        f.write(name + "\n")
    cmd = [sys.executable, "-c", TEMPLATE_SCRIPT, f"{PG_HOST}/{name}"]
    subprocess.run(cmd, cwd=copy, check=True)  # the copy's code, before anything is mutated
    return name


def drop_logged_databases(log: Path) -> int:
    """Drop the databases the run's sessions created that are still there; returns how many."""
    if not log.exists():
        return 0
    import psycopg

    names = {n.strip() for n in log.read_text().splitlines() if re.fullmatch(r"durable_\w+", n.strip())}
    dropped = 0
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
        existing = {r[0] for r in conn.execute("SELECT datname FROM pg_database")}
        for name in sorted(names & existing):
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            dropped += 1
    return dropped


@dataclass
class RunOptions:
    """What ``python -m tests.mutation`` was asked to do."""

    modules: list[str]
    jobs: int = 1
    out: Path | None = None
    keep: bool = False
    mutants: list[str] = field(default_factory=list)
    tests: list[str] = field(default_factory=list)  # instead of the targets' own
    timeout_multiplier: float = 3.0
    timeout_constant: float = 20.0
    test_timeout: int = 90
    log: Path | None = None
    kept: Path | None = None  # report this kept copy again instead of running
    backend: str | None = None  # only the tests of this backend (by test id)


SPINNER = re.compile(r"^[\u2800-\u28ff] ")
PROGRESS_EVERY = 15.0  # seconds between progress lines when the output is not a terminal


class Progress:
    """mutmut redraws one line with a spinner; on a terminal that passes through, elsewhere (a
    log file, nohup) the frames become a plain line every ``PROGRESS_EVERY`` seconds."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.pending = ""  # the latest spinner frame not yet printed
        self.printed_at = 0.0
        self.partial = ""

    def feed(self, text: str) -> None:
        if self.tty:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        self.partial += text
        *pieces, self.partial = re.split(r"[\r\n]", self.partial)
        for piece in pieces:
            self._piece(piece)

    def _piece(self, piece: str) -> None:
        if not piece.strip():
            return
        if SPINNER.match(piece):
            self.pending = piece[2:].strip()
            if time.monotonic() - self.printed_at >= PROGRESS_EVERY:
                self._emit(self.pending)
            return
        self._emit(piece)

    def _emit(self, line: str) -> None:
        print(line, flush=True)
        self.printed_at = time.monotonic()
        self.pending = ""

    def close(self) -> None:
        if self.partial.strip():
            self._piece(self.partial)
        if self.pending:
            self._emit(self.pending)


def run_mutmut(copy: Path, options: RunOptions, env: dict[str, str]) -> int:
    """``mutmut run`` in the copy, its output passed through (and to ``options.log``)."""
    cmd = [sys.executable, "-c", MUTMUT, "run", "--max-children", str(options.jobs), *options.mutants]
    log = open(options.log, "ab") if options.log else None  # noqa: SIM115
    # A session of its own: stopping the run stops mutmut and every mutant it forked, by group.
    proc = subprocess.Popen(
        cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    assert proc.stdout is not None
    progress = Progress()
    try:
        for chunk in iter(lambda: proc.stdout.read1(4096), b""):  # type: ignore[union-attr]
            progress.feed(chunk.decode(errors="replace"))
            if log:
                log.write(chunk)
                log.flush()
        progress.close()
        return proc.wait()
    except KeyboardInterrupt:
        print("mutation: stopping mutmut and its mutants", flush=True)
        stop_group(proc)
        raise
    finally:
        if log:
            log.close()


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop mutmut's process group: TERM, then KILL what is left after ten seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue


def interrupt_on_term() -> None:
    """SIGTERM (and SIGINT, which a shell's background job ignores) end the run like Ctrl-C:
    mutants stopped, the copy and the databases removed."""

    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, raise_interrupt)
    signal.signal(signal.SIGINT, raise_interrupt)


def collect(copy: Path, targets: Sequence[Target], env: dict[str, str]) -> list[ModuleResult]:
    """Read mutmut's verdicts per module, and the survivors' diffs."""
    equivalents = load_equivalents()
    results = []
    for target in targets:
        result = ModuleResult(target)
        meta = copy / "mutants" / (target.path + ".meta")
        if meta.exists():
            codes = json.loads(meta.read_text())["exit_code_by_key"]
            result.statuses = {name: STATUS.get(code, "suspicious") for name, code in codes.items()}
        for name, status in sorted(result.statuses.items()):
            if status in ("survived", "no tests"):
                diff = show(copy, name, env)
                result.diffs[name] = diff
                entry = match_equivalent(equivalents, target.path, name, diff)
                if entry is not None:
                    result.equivalent[name] = entry
        results.append(result)
    return results


def show(copy: Path, name: str, env: dict[str, str]) -> str:
    cmd = [sys.executable, "-c", MUTMUT, "show", name]
    done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    lines = done.stdout.splitlines()
    return "\n".join(line for line in lines if not line.startswith("# "))


def changed_lines(diff: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The removed and added lines of a unified diff, stripped (headers left out)."""
    removed = tuple(
        line[1:].strip() for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")
    )
    added = tuple(
        line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")
    )
    return removed, added


# ``db.statement("name", build)`` and ``db.bind("name", ...)``: the name only keys the cache of
# compiled statements, so a mutant that renames it (to another string, or None) changes nothing
# (a tuple name is not matched: changing a part of it can make two statements share a key).
STATEMENT_NAME = re.compile(r'(db\.(?:statement|bind)\()(None|"[^"]*")(,)')
RENAMED = Equivalent(
    "*", "statement cache name", "the name only keys the compiled-statement cache", (), (), "*"
)
# ``.cte("name")``: SQLAlchemy renders every reference to a CTE from the object, so its name
# only has to differ from the statement's other names, which a mutant's "XX...XX", upper case or
# None (an anonymous name SQLAlchemy makes unique) always does.
CTE_NAME = re.compile(r'(\.cte\()(None|"[^"]*")(\))')
CTE_RENAMED = Equivalent("*", "CTE name", "a CTE is referred to by object, not by its name", (), (), "*")


def renames(pattern: re.Pattern[str], removed: tuple[str, ...], added: tuple[str, ...]) -> bool:
    """Does the mutant only change the name ``pattern`` captures (a statement's, a CTE's)?"""
    if len(removed) != 1 or len(added) != 1 or removed == added:
        return False
    before, after = (pattern.sub(r"\1NAME\3", line) for line in (removed[0], added[0]))
    return before == after and pattern.search(removed[0]) is not None


def match_equivalent(equivalents: Sequence[Equivalent], path: str, name: str, diff: str) -> Equivalent | None:
    removed, added = changed_lines(diff)
    if renames(STATEMENT_NAME, removed, added):
        return RENAMED
    if renames(CTE_NAME, removed, added):
        return CTE_RENAMED
    for entry in equivalents:
        if entry.covers(path, name, removed, added):
            return entry
    return None


def report(results: Sequence[ModuleResult], out: Path | None) -> str:
    """The per-module table, then every live survivor's diff."""
    head = (
        f"{'module':<34} {'mutants':>7} {'killed':>6} {'survived':>8} {'timeout':>7} "
        f"{'no tests':>8} {'unchecked':>9} {'other':>5} {'equiv':>5} {'score':>6}"
    )
    lines = ["", head, "-" * len(head)]
    for r in results:
        counts = Counter(r.statuses.values())
        named = ("killed", "survived", "timeout", "no tests", "not checked")
        other = sum(n for s, n in counts.items() if s not in named)
        score = "-" if r.score is None else f"{100 * r.score:.1f}%"
        lines.append(
            f"{r.target.path:<34} {len(r.statuses):>7} {counts['killed']:>6} {counts['survived']:>8} "
            f"{counts['timeout']:>7} {counts['no tests']:>8} {counts['not checked']:>9} {other:>5} "
            f"{len(r.equivalent):>5} {score:>6}"
        )
    lines.append("")
    lines.append("score: (killed + timeout) / (mutants tested - equivalent); equivalents: equivalent.md")
    lines.append("unchecked: not tested (the run was interrupted); other: suspicious, segfault, type check")
    survivors = []
    for r in results:
        for name in r.alive:
            survivors.append(f"## {name} ({r.statuses[name]})\n{r.diffs.get(name, '(no diff)')}\n")
    text = "\n".join(lines)
    if survivors:
        text += f"\n\n# {len(survivors)} live survivor(s)\n\n" + "\n".join(survivors)
    else:
        text += "\n\nno live survivors\n"
    if out is not None:
        out.write_text(text)
    return text


def report_kept(copy: Path, options: RunOptions) -> int:
    """The report of a run kept with ``--keep``, read again (after equivalent.md changed, say)."""
    targets = [TARGETS[m] for m in options.modules]
    results = collect(copy, targets, dict(os.environ))
    print(report(results, options.out), flush=True)
    return 0


def run(options: RunOptions) -> int:
    """The whole run: copy, mutate and test, report, clean up. Returns an exit code."""
    if options.kept is not None:
        return report_kept(options.kept, options)
    targets = [TARGETS[m] for m in options.modules]
    interrupt_on_term()
    workdir = Path(tempfile.mkdtemp(prefix="durable-mutation-"))
    copy = workdir / "repo"
    db_log = workdir / "databases.txt"
    started = time.monotonic()
    try:
        n = copy_tree(REPO, copy)
        wanted = options.tests or [t for target in targets for t in target.tests]
        tests = expand_tests(copy, wanted)
        tests = list(dict.fromkeys(tests))
        print(f"mutation: {n} files copied to {copy}", flush=True)
        print(f"mutation: modules {', '.join(t.path for t in targets)}", flush=True)
        print(f"mutation: tests {' '.join(tests)}", flush=True)
        write_config(copy, targets, tests, options)
        # On PYTHONPATH (so processes a test starts run the mutant too): it must exist before
        # the interpreter starts, or the import system remembers it as missing.
        (copy / "mutants").mkdir()
        template = make_template(copy, db_log)
        with private_redis(workdir) as redis_url:
            env = {
                **os.environ,
                "DURABLE_TEST_REDIS": redis_url,
                "DURABLE_MUTATION_TEMPLATE": template,
                "DURABLE_MUTATION_DB_LOG": str(db_log),
                "PYTHONPATH": str(copy / "mutants"),
                "PYTHONDONTWRITEBYTECODE": "1",
            }
            try:
                code = run_mutmut(copy, options, env)
            except KeyboardInterrupt:
                code = 130
                print("mutation: interrupted; what was tested so far:", flush=True)
            results = collect(copy, targets, env)
        print(report(results, options.out), flush=True)
        minutes = (time.monotonic() - started) / 60
        print(f"mutation: mutmut exited {code}; {minutes:.1f} min", flush=True)
        if options.out is not None:
            print(f"mutation: report written to {options.out}", flush=True)
        return code
    finally:
        try:
            dropped = drop_logged_databases(db_log)
            if dropped:
                print(f"mutation: dropped {dropped} database(s) left by stopped mutants", flush=True)
        except Exception as exc:  # the report matters more than the clean-up
            print(f"mutation: could not drop leftover databases: {exc}", flush=True)
        if options.keep:
            print(f"mutation: kept {copy} (mutmut show/results/browse work there)", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
