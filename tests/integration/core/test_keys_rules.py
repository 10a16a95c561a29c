"""The key rules of DESIGN.md section 2, through the public API, on both backends."""

from __future__ import annotations

import threading
import time

import pytest

from durable_celery import InvalidKey, KeyTaken, SendEvent, current_run, signals
from durable_celery.testing import wait_for, worker

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["postgres", "sqlite", "fake"])
def backend(request: pytest.FixtureRequest) -> str:
    """These rules also hold on testing.Fake (the memory store), so it cannot drift from them."""
    return str(request.param)


REUSE_TABLE = {
    "after_close": {"unfinished": "taken", "completed": "free", "failed": "free", "cancelled": "free"},
    "after_failure": {"unfinished": "taken", "completed": "taken", "failed": "free", "cancelled": "free"},
    "never": {"unfinished": "taken", "completed": "taken", "failed": "taken", "cancelled": "taken"},
}


def define(durable, name="job", **options):
    """A one-step workflow that returns ``n`` or fails when told to."""
    wf = durable.workflow(name, **options)

    @wf.step(backoff=0.1)
    def work(n=0, fail=False):
        if fail:
            raise RuntimeError("told to fail")
        return n

    return wf


def make_holder(durable, wf, state, key="k"):
    """A run holding ``key`` in the given state."""
    if state == "unfinished":
        return durable.start(wf, {"n": 1}, key=key)
    if state == "cancelled":
        run_id = durable.start(wf, {"n": 1}, key=key)
        durable.cancel(run_id)
        return run_id
    run_id = durable.start(wf, {"n": 1, "fail": state == "failed"}, key=key)
    with worker(durable):
        assert wait_for(durable, run_id).status == state
    return run_id


def holders(durable, key="k"):
    return [r.id for r in durable.list_runs(key=key) if r.holds_key]


@pytest.mark.parametrize("reuse", list(REUSE_TABLE))
@pytest.mark.parametrize("state", ["unfinished", "completed", "failed", "cancelled"])
def test_reuse_table(durable, reuse, state):
    wf = define(durable, reuse=reuse)
    holder = make_holder(durable, wf, state)
    assert holders(durable) == [holder]
    second = durable.start(wf, {"n": 2}, key="k")
    if REUSE_TABLE[reuse][state] == "taken":
        assert second == holder
        assert [r.id for r in durable.list_runs(key="k")] == [holder]
        (dup,) = durable.activity(kinds=["key_duplicate"])
        assert dup.run_id == holder
        assert dup.details["outcome"] == "use_existing"
        assert dup.details["input_changed"] is True and dup.details["input"] == {"n": 2}
        assert dup.details["key"] == "k" and dup.details["workflow"] == "job"
    else:
        assert second != holder
        assert holders(durable) == [second]
        assert durable.get_run(holder).holds_key is False
        assert durable.get_run(holder).key == "k"  # history keeps the key
        (handoff,) = durable.activity(kinds=["key_handed_off"])
        assert handoff.run_id == second and handoff.details["from"] == holder
        assert handoff.details["key"] == "k" and handoff.details["workflow"] == "job"


def test_keys_are_scoped_per_workflow(durable):
    a, b = define(durable, "index_article"), define(durable, "process_article")
    first = durable.start(a, key="article:42")
    second = durable.start(b, key="article:42")
    assert first != second
    assert durable.get_run(first).holds_key and durable.get_run(second).holds_key


def test_duplicate_creates_nothing_and_sends_no_run_started(durable):
    wf = define(durable)
    started = []
    signals.run_started.connect(lambda sender, run_id, **kw: started.append(run_id), weak=False)
    try:
        holder = durable.start(wf, {"n": 1}, key="k")
        for _ in range(3):
            assert durable.start(wf, {"n": 1}, key="k") == holder
    finally:
        signals.run_started.receivers.clear()
    assert started == [holder]
    assert len(durable.list_runs()) == 1
    dups = durable.activity(kinds="key_duplicate")
    assert len(dups) == 3 and all(d.details["input_changed"] is False for d in dups)


class Gate:
    """A step that blocks until released, so its run is running (claimed) meanwhile."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.seen = []

    def define(self, durable, name="gated", **options):
        wf = durable.workflow(name, **options)

        @wf.step
        def hold(n=0):
            self.seen.append(n)
            self.entered.set()
            while not self.release.is_set():
                time.sleep(0.02)  # a Python loop: a cancel stops it at the next heartbeat
            return n

        return wf

    def wait_entered(self):
        assert self.entered.wait(10)
        self.entered.clear()


def test_error_policy_raises_key_taken_with_holder(durable):
    wf = define(durable, on_duplicate="error")
    holder = durable.start(wf, {"n": 1}, key="inv:1")
    with pytest.raises(KeyTaken) as info:
        durable.start(wf, {"n": 2}, key="inv:1")
    assert info.value.holder_id == holder
    assert durable.start(wf, {"n": 2}, key="inv:1", on_duplicate="use_existing") == holder
    outcomes = [a.details["outcome"] for a in durable.activity(kinds=["key_duplicate"])]
    assert outcomes == ["use_existing", "error"]
    assert len(durable.list_runs()) == 1


def test_cancel_existing_replaces_a_running_holder(durable):
    gate = Gate()
    wf = gate.define(durable)
    with worker(durable):
        holder = durable.start(wf, {"n": 1}, key="k")
        gate.wait_entered()
        new = durable.start(wf, {"n": 2}, key="k", on_duplicate="cancel_existing")
        assert new != holder
        old = durable.get_run(holder)
        assert old.status == "cancelled" and not old.holds_key
        assert new in old.error["message"] and old.error["replaced_by"] == new
        assert durable.get_run(new).holds_key
        gate.wait_entered()  # the replacement runs (the holder's step was stopped)
        gate.release.set()
        assert wait_for(durable, new).output == 2
    assert durable.list_steps(holder) == []
    kinds = [a.kind for a in durable.activity(kinds=["key_duplicate", "key_handed_off"])]
    assert sorted(kinds) == ["key_duplicate", "key_handed_off"]


def test_cancel_existing_works_under_reuse_never(durable):
    wf = define(durable, reuse="never")
    holder = durable.start(wf, {"n": 1}, key="k")
    new = durable.start(wf, {"n": 2}, key="k", on_duplicate="cancel_existing")
    assert new != holder and holders(durable) == [new]
    with worker(durable):
        assert wait_for(durable, new).output == 2
    with pytest.raises(KeyTaken):  # finished and kept by never: cancel_existing has nothing to cancel
        durable.start(wf, {"n": 3}, key="k", on_duplicate="cancel_existing")


def test_run_again_keeps_one_waiting_run_with_the_newest_input(durable):
    gate = Gate()
    wf = gate.define(durable, on_duplicate="run_again")
    with worker(durable):
        holder = durable.start(wf, {"n": 1}, key="acct:7")
        gate.wait_entered()
        waiting = durable.start(wf, {"n": 2}, key="acct:7")
        assert waiting != holder
        assert durable.start(wf, {"n": 3}, key="acct:7") == waiting
        assert durable.start(wf, {"n": 4}, key="acct:7") == waiting
        run = durable.get_run(waiting)
        assert run.status == "waiting" and run.runs_after_id == holder and not run.holds_key
        assert run.input == {"n": 4}
        assert len(durable.list_runs()) == 2
        gate.release.set()
        assert wait_for(durable, holder).status == "completed"
        assert wait_for(durable, waiting).output == 4
    assert gate.seen == [1, 4]
    assert holders(durable, "acct:7") == [waiting]
    dups = durable.activity(kinds=["key_duplicate"])
    assert {d.details["outcome"] for d in dups} == {"run_again"}
    assert all(d.run_id == holder and d.details["runs_after"] == waiting for d in dups)


def test_run_again_waiting_run_takes_the_key_when_the_holder_fails(durable):
    wf = durable.workflow("rebuild", on_duplicate="run_again", reuse="after_failure")
    entered, release = threading.Event(), threading.Event()

    @wf.step
    def rebuild(v):
        if v == 1:
            entered.set()
            release.wait(10)
            raise RuntimeError("index broken")
        return v

    with worker(durable):
        holder = durable.start(wf, {"v": 1}, key="idx")
        assert entered.wait(10)
        waiting = durable.start(wf, {"v": 2}, key="idx")
        release.set()
        assert wait_for(durable, holder).status == "failed"
        assert wait_for(durable, waiting).output == 2
    assert holders(durable, "idx") == [waiting]


def test_run_again_waiting_run_is_cancelled_when_reuse_keeps_the_key(durable):
    gate = Gate()
    wf = gate.define(durable, on_duplicate="run_again", reuse="after_failure")
    with worker(durable):
        holder = durable.start(wf, {"n": 1}, key="k")
        gate.wait_entered()
        waiting = durable.start(wf, {"n": 2}, key="k")
        gate.release.set()
        assert wait_for(durable, holder).status == "completed"
        run = wait_for(durable, waiting)
    assert run.status == "cancelled"
    assert "after_failure" in run.error["message"] and holder in run.error["message"]
    assert holders(durable) == [holder]


def test_run_again_gives_an_unclaimed_holder_the_newer_input(durable):
    wf = define(durable, on_duplicate="run_again")
    holder = durable.start(wf, {"n": 1}, key="k")
    assert durable.start(wf, {"n": 5}, key="k") == holder
    assert durable.get_run(holder).input == {"n": 5}
    assert len(durable.list_runs()) == 1
    with worker(durable):
        assert wait_for(durable, holder).output == 5


def test_run_again_with_reuse_never_is_refused_at_definition(durable):
    from durable_celery import InvalidDefinition

    with pytest.raises(InvalidDefinition):
        durable.workflow("bad", reuse="never", on_duplicate="run_again")


def test_send_event_buffers_input_until_the_holder_waits(durable):
    wf = durable.workflow("article", reuse="after_failure", on_duplicate=SendEvent("article_updated"))
    got = []
    entered, release = threading.Event(), threading.Event()

    @wf.step
    def publish(id, rev):
        entered.set()
        release.wait(10)
        return rev

    @wf.step
    def catch_up(id, rev):
        update = current_run().wait_for_event("article_updated", timeout=5, timeout_value="none")
        got.append(update)
        return update

    with worker(durable):
        holder = durable.start(wf, {"id": 42, "rev": 8}, key="article:42")
        assert entered.wait(10)
        # two saves arrive mid-step: kept, and the newest is what the wait gets
        assert durable.start(wf, {"id": 42, "rev": 9}, key="article:42") == holder
        assert durable.start(wf, {"id": 42, "rev": 10}, key="article:42") == holder
        release.set()
        run = wait_for(durable, holder)
    assert run.status == "completed" and run.output == {"id": 42, "rev": 10}
    assert got == [{"id": 42, "rev": 10}]
    assert len(durable.list_runs()) == 1
    outcomes = [a.details["outcome"] for a in durable.activity(kinds=["key_duplicate"])]
    assert outcomes == ["send_event", "send_event"]


def test_send_event_wakes_a_holder_already_waiting(durable):
    wf = durable.workflow("listener", on_duplicate=SendEvent("ping"))

    @wf.step
    def listen(n):
        return current_run().wait_for_event("ping")

    with worker(durable):
        holder = durable.start(wf, {"n": 1}, key="k")
        wait_for(durable, holder, statuses=("waiting",))
        assert durable.start(wf, {"n": 2}, key="k") == holder
        assert wait_for(durable, holder).output == {"n": 2}


def test_wait_for_event_timeout_returns_timeout_value(durable):
    wf = durable.workflow("patient")

    @wf.step
    def wait(n):
        return current_run().wait_for_event("never_sent", timeout=0.5, timeout_value="gave up")

    with worker(durable):
        run_id = durable.start(wf, {"n": 1})
        assert wait_for(durable, run_id).output == "gave up"


@pytest.mark.parametrize("policy", ["error", "cancel_existing", "run_again", SendEvent("e")])
def test_finished_holder_kept_by_reuse_refuses_every_policy_but_use_existing(durable, policy):
    wf = define(durable, reuse="after_failure")
    holder = make_holder(durable, wf, "completed")
    assert durable.start(wf, {"n": 2}, key="k", on_duplicate="use_existing") == holder
    with pytest.raises(KeyTaken) as info:
        durable.start(wf, {"n": 2}, key="k", on_duplicate=policy)
    assert info.value.holder_id == holder
    assert len(durable.list_runs()) == 1


def test_debounce_collapses_a_burst_into_one_run_with_the_last_input(durable):
    ran = []
    # The period is far longer than the gap between two starts, however slow the machine.
    wf = durable.workflow("index", debounce={"period": 2.0, "timeout": 30})

    @wf.step
    def index(rev):
        ran.append(rev)
        return rev

    with worker(durable):
        ids = set()
        for rev in range(1, 6):
            ids.add(durable.start(wf, {"rev": rev}, key="article:1"))
            time.sleep(0.1)
        assert len(ids) == 1
        (run_id,) = ids
        run = wait_for(durable, run_id)
    assert ran == [5] and run.output == 5
    assert (run.started_at - run.created_at).total_seconds() >= 2.0 + 0.4  # restarted each time
    outcomes = [a.details["outcome"] for a in durable.activity(kinds=["key_duplicate"])]
    assert outcomes == ["debounced"] * 4


def test_debounce_timeout_caps_the_wait_and_later_starts_are_ordinary_duplicates(durable):
    ran = []
    # A period ten times the gap between saves: a loaded machine never stretches a gap that far.
    wf = durable.workflow("sync", debounce={"period": 1.0, "timeout": 2.0})

    @wf.step
    def sync(rev):
        ran.append(rev)
        time.sleep(0.3)
        return rev

    with worker(durable):
        first = durable.start(wf, {"rev": 0}, key="k")
        rev, ids, saved = 0, {first}, [time.monotonic()]
        deadline = saved[0] + 3.5
        while time.monotonic() < deadline:  # saves keep coming every 0.1 s, longer than the cap
            rev += 1
            ids.add(durable.start(wf, {"rev": rev}, key="k"))
            saved.append(time.monotonic())
            time.sleep(0.1)
        run = wait_for(durable, first)
        for run_id in ids:
            wait_for(durable, run_id)
    # the first run started within the cap, with an input from before it was claimed
    waited = (run.started_at - run.created_at).total_seconds()
    assert waited < 2.0 + 1.5
    # Before the claim, did a save come later than the period after the one before (a start
    # held up that long by a loaded machine)? Then the run rightly started before the cap.
    gaps = [b - a for a, b in zip(saved, saved[1:], strict=False) if b - saved[0] <= waited]
    if max(gaps, default=0.0) < 0.9:
        assert waited >= 2.0, (waited, max(gaps, default=0.0))
    assert run.output == ran[0] and 0 < ran[0] < rev
    outcomes = {a.details["outcome"] for a in durable.activity(kinds=["key_duplicate"])}
    assert {"debounced", "use_existing"} <= outcomes


def test_unkeyed_starts_are_not_debounced(durable):
    wf = durable.workflow("plain", debounce={"period": 30})

    @wf.step
    def go():
        return "now"

    with worker(durable):
        a, b = durable.start(wf), durable.start(wf)
        assert a != b
        assert wait_for(durable, a, timeout=10).output == "now"
        assert wait_for(durable, b, timeout=10).output == "now"


@pytest.mark.parametrize("key", ["", "x" * 256, "é" * 128, 7, b"k", ("k",)])
def test_invalid_keys_write_nothing(durable, key):
    wf = define(durable)
    with pytest.raises(InvalidKey):
        durable.start(wf, key=key)
    assert durable.list_runs() == [] and durable.list_keys() == []


@pytest.mark.parametrize("key", ["x" * 255, "é" * 127 + "x", "日本語" * 28])
def test_keys_up_to_255_utf8_bytes_work(durable, key):
    wf = define(durable)
    run_id = durable.start(wf, key=key)
    assert durable.start(wf, key=key) == run_id
    assert [k.key for k in durable.list_keys()] == [key]


def test_idempotency_required_and_off(durable):
    from durable_celery import InvalidStart

    payout = define(durable, "payout", idempotency="required")
    with pytest.raises(InvalidStart):
        durable.start(payout)
    ping = define(durable, "ping", idempotency="off")
    assert durable.start(ping, key="same") != durable.start(ping, key="same")
    assert durable.list_keys() == []


def test_key_template_on_decorated_workflow(durable):
    @durable.workflow(key="article:{id}", reuse="after_failure")
    def process_article(id):
        return id

    run_id = process_article.start({"id": 42})
    assert durable.get_run(run_id).key == "article:42"
    assert process_article.start({"id": 42}) == run_id


def test_workflow_timeout_fails_a_run_and_stops_its_step(durable):
    progress = []
    wf = durable.workflow("bounded", timeout=0.6)

    @wf.step
    def crawl():
        for i in range(200):
            progress.append(i)
            time.sleep(0.05)
        return "finished"

    with worker(durable):
        run = wait_for(durable, durable.start(wf), timeout=15)
        failed_at = time.monotonic()
        while True:  # the step notices at its next timed heartbeat (0.3 s in tests)
            seen = len(progress)
            time.sleep(0.5)
            if len(progress) == seen:
                break
            assert time.monotonic() - failed_at < 5, "step still running after its run timed out"
    assert run.status == "failed" and run.error["type"] == "WorkflowTimeout"
    assert "finished" not in progress


def test_workflow_timeout_fails_a_run_no_worker_takes(durable, backend):
    if backend == "fake":
        pytest.skip("a Fake runs the steps of every queue: none is left without a consumer")
    wf = durable.workflow("stranded", timeout=0.5, queue="nobody-listens-here")

    @wf.step
    def never():
        raise AssertionError("must not run")

    with worker(durable):
        run = wait_for(durable, durable.start(wf), timeout=15)
    assert run.status == "failed" and run.error["type"] == "WorkflowTimeout"


def test_debounced_run_timeout_counts_from_when_it_is_due(durable):
    wf = durable.workflow("late_start", timeout=1.0, debounce={"period": 1.5})

    @wf.step
    def go():
        return "ran"

    with worker(durable):
        run = wait_for(durable, durable.start(wf, key="k"), timeout=15)
    # 1.5 s of debounce is longer than the timeout, which only starts counting once due
    assert run.status == "completed" and run.output == "ran"


def test_run_again_run_timeout_counts_from_when_it_takes_the_key(durable):
    entered, release = threading.Event(), threading.Event()
    wf = durable.workflow("relay_race", on_duplicate="run_again", timeout=4.0)

    @wf.step
    def hold(n=0):
        if n == 1:
            entered.set()
            release.wait(30)
        else:
            time.sleep(2.0)  # half its timeout, once it has the key
        return n

    with worker(durable):
        holder = durable.start(wf, {"n": 1}, key="k")
        assert entered.wait(10)
        waiting = durable.start(wf, {"n": 2}, key="k")
        time.sleep(2.5)  # the holder runs on: what it leaves of 4 s is less than the waiting run takes
        release.set()
        assert wait_for(durable, holder).status == "completed"
        run = wait_for(durable, waiting, timeout=15)
    assert run.status == "completed" and run.output == 2
    assert (run.finished_at - run.created_at).total_seconds() > 4.0  # longer than its timeout, all told


def test_cancel_existing_refuses_a_compensating_holder(durable):
    # Compensations come with their own release; the status is set directly to test the rule.
    from sqlalchemy import update

    from durable_celery.store.schema import runs

    wf = define(durable)
    holder = durable.start(wf, {"n": 1}, key="k")
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == holder).values(status="compensating"))
    with pytest.raises(KeyTaken) as info:
        durable.start(wf, {"n": 2}, key="k", on_duplicate="cancel_existing")
    assert info.value.holder_id == holder
    assert durable.get_run(holder).status == "compensating"
    assert durable.start(wf, {"n": 2}, key="k") == holder  # still holds it: use_existing
    assert durable.cancel(holder) is False  # a compensating run finishes what it started
    assert len(durable.list_runs()) == 1
