"""Bulk actions (issue 43): the provider-outage incident end to end (a dry run, the retry of every
``charge`` that failed in a window for one tenant, not the ones cancelled since, run again
without acting twice), and a bulk retry racing real workers, cancels and new starts with the
same keys: no run acted on twice, never two runs of one key."""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update

from durable_celery import current_run
from durable_celery.errors import InvalidArgument, KeyTaken
from durable_celery.store.schema import runs
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(120)

# Orders whose payment fails while the provider is down (this module's runs only).
_down: set[int] = set()


def _charge(durable: Any) -> Any:
    wf = durable.workflow("charge", key="charge:{order}")

    @wf.step
    def pay(order: int) -> str:
        if order in _down:
            raise ConnectionError("provider down")
        return f"PAY-{order}"

    return wf


def _set(durable: Any, run_id: str, **values: Any) -> None:
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(**values))


def test_the_provider_outage_retry_by_filter_with_a_dry_run_and_run_again(durable: Any) -> None:
    wf = _charge(durable)
    now = durable.db.utcnow().astimezone()
    window = (now - timedelta(minutes=30), now - timedelta(minutes=15))
    made: dict[str, list[str]] = {"acme_in": [], "acme_cancelled": [], "other": [], "acme_before": []}
    for n in range(40):
        tenant = "acme" if n % 4 else "globex"
        _down.add(1000 + n)
        run_id = durable.start(wf, {"order": 1000 + n}, tags={"tenant": tenant})
        assert durable.run_message("charge", 0, run_id) == "failed"
        group = "other" if tenant == "globex" else "acme_before" if n < 8 else "acme_in"
        created = (
            window[0] + timedelta(seconds=10 * n)
            if group != "acme_before"
            else window[0] - timedelta(hours=1)
        )
        _set(durable, run_id, created_at=created)
        made[group].append(run_id)
    for run_id in made["acme_in"][:3]:  # the customer cancelled these since: not failed any more
        _set(durable, run_id, status="cancelled")
        made["acme_cancelled"].append(run_id)
    wanted = [r for r in made["acme_in"] if r not in made["acme_cancelled"]]
    where = {
        "workflow": "charge",
        "status": "failed",
        "tags": {"tenant": "acme"},
        "since": window[0],
        "until": window[1],
    }
    _down.clear()  # the provider is back

    preview = durable.bulk("retry", dry_run=True, by="ops", **where)
    assert (preview.matched, preview.acted, preview.skipped) == (len(wanted), len(wanted), {})
    assert all(durable.get_run(r).status == "failed" for r in wanted)  # a dry run changes nothing

    report = durable.bulk("retry", by="ops", **where)
    assert (report.matched, report.acted) == (len(wanted), len(wanted))
    for run_id in wanted:
        assert durable.run_message("charge", 0, run_id) == "completed"
    assert all(durable.get_run(r).status == "failed" for r in made["other"] + made["acme_before"])
    assert all(durable.get_run(r).status == "cancelled" for r in made["acme_cancelled"])
    again = durable.bulk("retry", by="ops", **{**where, "status": None})  # every status: skips what it did
    assert again.acted == 0 and again.skipped == {
        "not failed (completed)": len(wanted),
        "not failed (cancelled)": 3,
    }
    entries = durable.activity(kinds=["bulk"])
    assert [(e.details["acted"], e.details["dry_run"], e.details["by"]) for e in entries][:3] == [
        (0, False, "ops"),
        (len(wanted), False, "ops"),
        (len(wanted), True, "ops"),
    ]
    assert entries[1].details["filter"]["tags"] == {"tenant": "acme"}
    history = durable.activity(kinds=["retried"], run_id=wanted[0])
    assert [e.details["from"] for e in history] == [f"bulk {report.bulk_id}"]


def test_a_bulk_rerun_run_again_skips_what_it_did_and_a_bulk_needs_a_filter(durable: Any) -> None:
    wf = _charge(durable)
    done = [durable.start(wf, {"order": n}, tags={"batch": "b1"}) for n in range(5)]
    for run_id in done:
        assert durable.run_message("charge", 0, run_id) == "completed"
    first = durable.bulk("rerun", tags={"batch": "b1"}, status="completed")
    assert first.acted == 5 and len(first.made) == 5
    again = durable.bulk("rerun", tags={"batch": "b1"}, status="completed")
    assert again.acted == 0 and again.skipped == {"rerun done by this bulk action before": 5}
    assert len(durable.list_runs(workflow="charge", limit=100)) == 10
    with pytest.raises(InvalidArgument, match="needs a filter"):
        durable.bulk("cancel")
    with pytest.raises(InvalidArgument, match="unknown bulk action"):
        durable.bulk("delete", workflow="charge")
    with pytest.raises(InvalidArgument, match="from_step"):
        durable.bulk("fork", workflow="charge")


def test_a_bulk_retry_racing_workers_cancels_and_new_starts_acts_once_and_one_run_per_key(
    durable: Any,
) -> None:
    """Failed keyed runs retried in bulk while a worker runs the retried ones, another thread
    cancels some, and a third starts new runs with the same keys: every run is retried at most
    once, and no key ever has two runs that ran (the key's holder is one run)."""
    wf = durable.workflow("flaky", key="flaky:{order}")
    failing: set[int] = set(range(60))

    @wf.step
    def pay(order: int) -> int:
        if order in failing:
            raise ConnectionError("down")
        current_run().context["paid"] = True
        return order

    ids = [durable.start(wf, {"order": n}) for n in range(60)]
    for run_id in ids:
        assert durable.run_message("flaky", 0, run_id) == "failed"
    failing.clear()
    report, started, seen = _race(durable, wf, ids)
    assert report.acted + sum(report.skipped.values()) == report.matched
    for run_id in ids:  # acted on at most once
        assert len(durable.activity(kinds=["retried"], run_id=run_id)) <= 1
    assert seen and all(count <= 1 for count in seen), seen  # never two unfinished runs of one key
    # A run still failed was skipped: a new start took its key first, and that run completed.
    still_failed = [durable.get_run(r) for r in ids if durable.get_run(r).status == "failed"]
    assert len(still_failed) <= sum(report.skipped.values())
    completed_keys = {durable.get_run(r).key for r in started if durable.get_run(r).status == "completed"}
    assert {run.key for run in still_failed} <= completed_keys


def _race(durable: Any, wf: Any, ids: list[str]) -> tuple[Any, list[str], list[int]]:
    """The bulk retry, with a worker, a thread cancelling and one starting the same keys again,
    while a sampler counts each key's unfinished runs: (report, runs started, largest counts)."""
    started: list[str] = []
    seen: list[int] = []
    gate, over = threading.Barrier(3), threading.Event()

    def cancel_some() -> None:
        gate.wait()
        for run_id in ids[::7]:
            durable.cancel(run_id, by="customer")

    def start_again() -> None:
        gate.wait()
        for n in range(0, 60, 5):
            with contextlib.suppress(KeyTaken):
                started.append(durable.start(wf, {"order": n}, on_duplicate="error"))

    def sample() -> None:
        while not over.is_set():
            going = durable.list_runs(workflow="flaky", status=["pending", "running", "waiting"], limit=1000)
            keys = [run.key for run in going]
            seen.append(max((keys.count(k) for k in keys), default=0))

    with worker(durable):
        threads = [threading.Thread(target=f) for f in (cancel_some, start_again, sample)]
        for thread in threads:
            thread.start()
        gate.wait()
        report = durable.bulk("retry", workflow="flaky", status="failed", by="ops")
        for run_id in [*ids, *started]:
            wait_for(durable, run_id, timeout=60)
        over.set()
        for thread in threads:
            thread.join(30)
    return report, started, seen


def test_a_bulk_action_walks_its_runs_in_pages_and_says_how_far_it_got(
    durable: Any, monkeypatch: Any
) -> None:
    from durable_celery.core import bulk as bulk_actions

    monkeypatch.setattr(bulk_actions, "BATCH", 7)
    wf = durable.workflow("paged")
    wf.step(lambda n: n, name="only")
    ids = [durable.start(wf, {"n": n}, tags={"page": "yes"}) for n in range(30)]
    said: list[str] = []
    report = durable.bulk("cancel", tags={"page": "yes"}, progress=said.append)
    assert (report.matched, report.acted) == (30, 30)
    assert said == [f"{n:,} of 30 runs looked at" for n in (7, 14, 21, 28, 30)]
    assert {durable.get_run(r).status for r in ids} == {"cancelled"}


def test_an_interrupted_bulk_action_leaves_its_entry_and_run_again_does_the_rest(
    durable: Any, monkeypatch: Any
) -> None:
    from durable_celery.core import bulk as bulk_actions

    monkeypatch.setattr(bulk_actions, "BATCH", 5)
    wf = durable.workflow("cut")
    wf.step(lambda n: n, name="only")
    ids = [durable.start(wf, {"n": n}, tags={"cut": "yes"}) for n in range(12)]

    def stop_after_first_page(line: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        durable.bulk("cancel", tags={"cut": "yes"}, by="ops", progress=stop_after_first_page)
    (cut,) = durable.activity(kinds="bulk", workflow=None)
    assert cut.details["interrupted"] is True and cut.details["acted"] == 5 and cut.details["by"] == "ops"
    assert sum(durable.get_run(r).status == "cancelled" for r in ids) == 5
    report = durable.bulk("cancel", tags={"cut": "yes"}, by="ops")
    assert report.bulk_id == cut.details["bulk"]
    assert (report.acted, sum(report.skipped.values())) == (7, 5)
    assert {durable.get_run(r).status for r in ids} == {"cancelled"}
