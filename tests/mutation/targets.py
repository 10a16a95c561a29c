"""Which tests cover which core module: a mutant of a module runs only the tests mapped to it
(and of those, only the ones that call the mutated function: mutmut records that per test)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Tests every module shares: those written against mutants (and the guards of issues 12 and 16),
# cheap and aimed. Whole files, and the node ids of such tests kept in other behaviour files.
GUARDS = [
    "tests/integration/core/test_engine_*.py",
    "tests/integration/core/test_heartbeat.py",
    "tests/integration/core/test_keys_records.py",
    "tests/integration/core/test_keys_contention.py",
    "tests/integration/core/test_keys_debounce.py",
    "tests/integration/core/test_control.py",
    "tests/integration/core/test_sweeps.py",
    "tests/integration/core/test_continuation.py::test_an_inline_chain_goes_on_after_an_outage_interrupted_a_write",
    "tests/integration/core/test_continuation.py::"
    "test_a_durable_sends_no_task_events_for_inline_steps_until_its_worker_says_it_sends_them",
    "tests/integration/store/test_claims.py",
    "tests/integration/store/test_reads.py",
    "tests/integration/store/test_keys_listing.py",
    "tests/integration/worker/test_upkeep_threads.py",
    "tests/integration/worker/test_upkeep_bootstep.py",
    "tests/integration/worker/test_relay.py::test_a_start_on_a_bare_connection_flags_only_its_own_run_for_the_relay",
    "tests/integration/worker/test_relay.py::test_a_lost_message_is_sent_again_only_relay_after_its_run_became_due",
    "tests/integration/worker/test_relay.py::"
    "test_only_sent_unclaimed_runs_of_this_build_count_against_the_messages_queued",
    "tests/integration/worker/test_relay.py::"
    "test_a_debounce_restarted_after_the_relay_sent_its_run_waits_its_whole_period",
    "tests/integration/worker/test_relay.py::test_the_relay_passes_over_a_run_another_relay_holds",
    "tests/integration/worker/test_relay.py::test_a_relay_pass_takes_its_runs_a_batch_at_a_time",
    "tests/integration/schedules/test_schedule_restore.py::test_the_sweep_restores_a_vanished_redbeat_entry",
    "tests/integration/test_fake_due_runs.py",
    "tests/unit/test_keys_decision.py",
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
            "durable_celery/core/keys.py",
            [
                "tests/integration/core/test_keys_rules.py",
                "tests/integration/core/test_keys_control.py",
                # the rest of issue 12's guards (the others are among the GUARDS)
                "tests/integration/core/test_bad_input.py::"
                "test_run_again_per_call_is_refused_under_reuse_never_and_writes_nothing",
                "tests/integration/core/test_prune.py::test_cleanup_takes_a_bare_number_as_seconds",
                "tests/integration/core/test_prune.py::test_cleanup_still_refuses_what_is_not_a_positive_duration",
                "tests/integration/core/test_prune.py::test_cli_cleanup_older_than_a_bare_number_of_seconds",
                # a start's rate limit, checked where the key decision creates a run
                "tests/integration/core/test_flow_control.py::test_rate_limit_refuses_past_the_limit_and_writes_nothing",
                "tests/integration/core/test_flow_control.py::"
                "test_a_duplicate_answered_by_the_holder_counts_against_no_limit",
                *GUARDS,
            ],
            "the start decision: reuse x on_duplicate, debounce, hand-off",
        ),
        Target(
            "key_rows",
            "durable_celery/store/key_rows.py",
            [
                "tests/integration/core/test_keys_control.py",
                "tests/integration/cli/test_cli_keys.py",
                *GUARDS,
            ],
            "statements on durable_keys",
        ),
        Target(
            "queries",
            "durable_celery/store/queries.py",
            [
                "tests/integration/core/test_running.py",
                "tests/integration/worker/test_relay.py",
                "tests/integration/core/test_keys_rules.py",
                "tests/integration/core/test_keys_control.py",
                "tests/integration/core/test_continuation.py",
                "tests/integration/core/test_rollout.py",
                "tests/integration/core/test_waits.py",
                "tests/integration/observe/test_metrics.py",
                *GUARDS,
            ],
            "claims, fencing, records, relay, sweeps",
        ),
        Target(
            "control",
            "durable_celery/core/control.py",
            [
                "tests/integration/core/test_keys_control.py",
                "tests/integration/core/test_children.py",
                "tests/integration/core/test_waits.py",
                *GUARDS,
            ],
            "cancel, retry, rerun, release-key, events",
        ),
        Target(
            "engine",
            "durable_celery/core/engine.py",
            [
                "tests/integration/core/test_running.py",
                "tests/integration/core/test_compensation.py",
                "tests/integration/core/test_waits.py",
                "tests/integration/core/test_continuation.py",
                "tests/integration/core/test_rollout.py",
                "tests/integration/instrument/test_logs.py",
                "tests/integration/instrument/test_tracing.py",
                "tests/integration/core/test_children.py",
                *GUARDS,
            ],
            "claim, run, record, retry, compensate",
        ),
        Target(
            "outcomes",
            "durable_celery/core/outcomes.py",
            [
                "tests/integration/core/test_running.py",
                "tests/integration/core/test_compensation.py",
                "tests/integration/core/test_waits.py",
                "tests/integration/core/test_continuation.py",
                "tests/integration/core/test_children.py",
                *GUARDS,
            ],
            "a step attempt's outcome and the run's next state (split out of engine.py)",
        ),
        Target(
            "flow",
            "durable_celery/core/flow.py",
            [
                "tests/integration/core/test_flow_control.py",
                "tests/integration/observe/test_flow_watch.py",
                "tests/integration/schedules/test_schedules.py",
            ],
            "flow control per key: concurrency slots, throttle, rate limit",
        ),
        Target(
            "flow_rows",
            "durable_celery/store/flow_rows.py",
            [
                "tests/integration/core/test_flow_control.py",
                "tests/integration/observe/test_flow_watch.py",
            ],
            "flow control's statements: locks, bounded counts, parking and waking",
        ),
        Target(
            "upkeep",
            "durable_celery/worker/upkeep.py",
            [
                "tests/integration/worker/test_relay.py",
                "tests/integration/store/test_database_down.py",
                "tests/integration/worker/test_outbox.py",
                "tests/integration/core/test_children.py",
                "tests/integration/core/test_waits.py",
                "tests/integration/core/test_queues.py",
                "tests/integration/store/test_migrations.py",
                "tests/integration/observe/test_metrics.py",
                *GUARDS,
            ],
            "stale sweep, timeouts, orphans, the upkeep threads",
        ),
    )
}
