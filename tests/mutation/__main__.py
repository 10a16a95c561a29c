"""``python -m tests.mutation [module ...]``: mutation testing of the core modules (mutmut 3).

Mutates a private copy of the repository, never the working tree; see docs/development.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .runner import RunOptions, run
from .targets import TARGETS


def parse(argv: list[str]) -> RunOptions:
    names = ", ".join(TARGETS)
    parser = argparse.ArgumentParser(
        prog="python -m tests.mutation",
        description=(
            "Mutate core modules of durable_celery in a temporary copy of the repository and run the "
            "tests mapped to each (tests/mutation/targets.py); print per module the mutants, killed, "
            "survived and timed out, and the diffs of the survivors not listed in "
            "tests/mutation/equivalent.md. Needs PostgreSQL (DURABLE_TEST_PG) and redis-server."
        ),
        epilog="examples: python -m tests.mutation keys key_rows   |   python -m tests.mutation --list",
    )
    parser.add_argument("modules", nargs="*", metavar="module", help=f"one of: {names} (default: all)")
    parser.add_argument("--list", action="store_true", help="list the modules and their tests, and exit")
    parser.add_argument(
        "-j", "--jobs", type=int, default=1, help="mutants tested at once (default 1: tests are timing-aware)"
    )
    parser.add_argument("-o", "--out", type=Path, help="also write the table and survivors' diffs here")
    parser.add_argument("--log", type=Path, help="append mutmut's own output to this file")
    parser.add_argument(
        "--mutant",
        action="append",
        default=[],
        metavar="NAME",
        help="only these mutants (mutmut names, * globs allowed, e.g. 'durable_celery.core.keys.x_reuse_frees*')",  # noqa: E501
    )
    parser.add_argument(
        "--tests", action="append", default=[], metavar="PATH", help="run these tests, not the mapped ones"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy (for mutmut show there)")
    parser.add_argument(
        "--report", type=Path, metavar="DIR", help="only report again on a copy kept with --keep (DIR/repo)"
    )
    parser.add_argument(
        "--timeout-multiplier",
        type=float,
        default=3.0,
        help="a mutant is stopped (timeout) after (its tests' clean time + constant) x this (default 3)",
    )
    parser.add_argument("--timeout-constant", type=float, default=20.0, help="seconds (default 20)")
    parser.add_argument("--test-timeout", type=int, default=90, help="pytest-timeout per test, seconds")
    parser.add_argument(
        "--backend",
        choices=["postgres", "sqlite"],
        help="run the tests of this backend only (half the time; the other backend's own code paths "
        "then go untested)",
    )
    args = parser.parse_args(argv)
    if args.list:
        for target in TARGETS.values():
            print(f"{target.name:<10} {target.path:<34} {target.note}")
            for test in target.tests:
                print(f"{'':<10}   {test}")
        sys.exit(0)
    unknown = [m for m in args.modules if m not in TARGETS]
    if unknown:
        parser.error(f"unknown module(s) {', '.join(unknown)}; choose from {names}")
    return RunOptions(
        modules=args.modules or list(TARGETS),
        jobs=args.jobs,
        out=args.out,
        keep=args.keep,
        mutants=args.mutant,
        tests=args.tests,
        timeout_multiplier=args.timeout_multiplier,
        timeout_constant=args.timeout_constant,
        test_timeout=args.test_timeout,
        log=args.log,
        kept=args.report,
        backend=args.backend,
    )


def main(argv: list[str] | None = None) -> int:
    return run(parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
