"""Which tests cover which core module: a mutant of a module runs only the tests mapped to it
(and of those, only the ones that call the mutated function: mutmut records that per test)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Tests every module shares: the guards written against mutants, cheap and aimed.
GUARDS = [
    "tests/integration/test_core_guards.py",
    "tests/integration/test_mutation_*.py",
    "tests/unit/test_mutation_*.py",
]


@dataclass(frozen=True)
class Target:
    """One module under mutation and the tests that cover it."""

    name: str  # short name, as given on the command line
    path: str  # the file mutated, relative to the repository
    tests: list[str] = field(default_factory=list)  # pytest arguments: files, globs or node ids
    note: str = ""


TARGETS = {
    t.name: t
    for t in (
        Target(
            "keys",
            "durable_celery/keys.py",
            [
                "tests/integration/test_keys_rules.py",
                "tests/integration/test_keys_control.py",
                "tests/integration/test_audit_fixes.py",
                *GUARDS,
            ],
            "the start decision: reuse x on_duplicate, debounce, hand-off",
        ),
        Target(
            "key_rows",
            "durable_celery/store/key_rows.py",
            ["tests/integration/test_keys_control.py", "tests/integration/test_cli_keys.py", *GUARDS],
            "statements on durable_keys",
        ),
        Target(
            "queries",
            "durable_celery/store/queries.py",
            [
                "tests/integration/test_running.py",
                "tests/integration/test_relay.py",
                "tests/integration/test_keys_rules.py",
                "tests/integration/test_keys_control.py",
                "tests/integration/test_continuation.py",
                "tests/integration/test_rollout.py",
                "tests/integration/test_waits.py",
                "tests/integration/test_metrics.py",
                *GUARDS,
            ],
            "claims, fencing, records, relay, sweeps",
        ),
        Target(
            "control",
            "durable_celery/control.py",
            [
                "tests/integration/test_keys_control.py",
                "tests/integration/test_children.py",
                "tests/integration/test_waits.py",
                *GUARDS,
            ],
            "cancel, retry, rerun, release-key, events",
        ),
        Target(
            "engine",
            "durable_celery/engine.py",
            [
                "tests/integration/test_running.py",
                "tests/integration/test_compensation.py",
                "tests/integration/test_waits.py",
                "tests/integration/test_continuation.py",
                "tests/integration/test_rollout.py",
                "tests/integration/test_logs.py",
                "tests/integration/test_tracing.py",
                "tests/integration/test_children.py",
                *GUARDS,
            ],
            "claim, run, record, retry, compensate",
        ),
        Target(
            "upkeep",
            "durable_celery/upkeep.py",
            [
                "tests/integration/test_relay.py",
                "tests/integration/test_database_down.py",
                "tests/integration/test_outbox.py",
                "tests/integration/test_children.py",
                "tests/integration/test_waits.py",
                "tests/integration/test_queues.py",
                "tests/integration/test_migrations.py",
                "tests/integration/test_metrics.py",
                *GUARDS,
            ],
            "stale sweep, timeouts, orphans, the upkeep threads",
        ),
    )
}
