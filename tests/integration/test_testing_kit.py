"""The testing kit: the in-memory store, capabilities, the Fake, eager mode and run_context."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery

from durable_celery import (
    Capability,
    ChildFailed,
    Durable,
    InvalidArgument,
    KeyTaken,
    SendEvent,
    Unsupported,
    current_run,
    durable_workflow,
)
from durable_celery.testing import (
    CallingWorkflow,
    Fake,
    Sleeping,
    Snoozing,
    WaitingForEvent,
    WaitingForInput,
    run_context,
    wait_for,
    worker,
)

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def memory_app(name: str = "kit", **conf: object) -> Celery:
    app = Celery(name, set_as_current=False)
    app.conf.update(conf)
    return app


# -- the in-memory store ---------------------------------------------------------------------


def test_memory_store_runs_keys_waits_compensation_and_children_with_a_worker_thread(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written here
    durable = Durable(memory_app(), "memory://")
    assert durable.app.conf.broker_url.startswith("memory://")
    undone = []

    child = durable.workflow("child")

    @child.step
    def double(n):
        return {"n": n * 2}

    parent = durable.workflow("parent")

    @parent.step
    def call(n):
        return {"n": current_run().call_workflow(child, {"n": n})["n"]}

    @parent.step
    def wait(n):
        return {"n": n + current_run().wait_for_event("more")}

    saga = durable.workflow("saga")

    @saga.step(compensate=lambda **_: undone.append("reserve"))
    def reserve():
        return {}

    @saga.step(retry=1)
    def charge():
        raise RuntimeError("card declined")

    with worker(durable):
        run_id = durable.start(parent, {"n": 3}, key="order:1")
        assert durable.start(parent, {"n": 9}, key="order:1") == run_id  # held: the same run
        durable.send_event(run_id, "more", 1, buffer=True)  # kept until the step waits for it
        assert wait_for(durable, run_id).output == {"n": 4}  # every step gets the run's input
        assert wait_for(durable, durable.start(saga)).status == "compensated"
    assert undone == ["reserve"]
    assert [r.workflow for r in durable.list_children(run_id)] == ["child"]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("url", ["memory://", "sqlite://", "sqlite:///:memory:"])
def test_memory_urls_are_fresh_stores_migrated_on_first_use(url):
    a, b = Durable(memory_app(), url), Durable(memory_app(), url)
    for durable in (a, b):
        durable.workflow("w")(_noop)
    assert a.pending_migrations() == []
    run_id = a.start("w", key="k")
    assert a.get_run(run_id).status == "pending"
    assert b.list_runs() == []  # each its own store
    assert (
        a.capabilities
        == Capability.ALL & ~Capability.SKIP_LOCKED & ~Capability.MULTI_PROCESS & ~Capability.ATOMIC_STEPS
    )


def test_named_memory_store_is_shared_in_the_process_and_a_fresh_one_goes_with_its_durable():
    name = f"kit-{os.getpid()}-{threading.get_ident()}"
    a, b = Durable(memory_app(), f"memory://{name}"), Durable(memory_app(), f"memory://{name}")
    for durable in (a, b):
        durable.workflow("w")(_noop)
    run_id = a.start("w", key="shared")
    assert b.start("w", key="shared") == run_id  # one key table
    fake = Fake()
    path = fake.db.url.removeprefix("sqlite:///")
    assert os.path.exists(path) and path.startswith(("/dev/shm/", "/tmp/"))
    fake.close()
    assert not os.path.exists(path)


def test_bad_memory_name_is_refused():
    with pytest.raises(Exception, match="memory store's name"):
        Durable(memory_app(), "memory://no/slashes").db.engine  # noqa: B018


def test_memory_store_refuses_a_prefork_worker(tmp_path):
    app_file = tmp_path / "memapp.py"
    app_file.write_text(
        textwrap.dedent(
            """
            from celery import Celery
            from durable_celery import Durable
            app = Celery("memapp")
            durable = Durable(app, "memory://")
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "memapp", "worker", "--pool", "prefork", "-c", "1"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "one process only (missing MULTI_PROCESS)" in done.stderr
    assert "--pool threads" in done.stderr


# -- capabilities ----------------------------------------------------------------------------


def test_capabilities_of_each_backend(pg_url, tmp_path):
    assert Durable(memory_app(), pg_url).capabilities == Capability.ALL
    sqlite = Durable(memory_app(), f"sqlite:///{tmp_path}/file.sqlite3")
    assert sqlite.capabilities == Capability.ALL & ~Capability.SKIP_LOCKED & ~Capability.ATOMIC_STEPS
    assert Capability.MULTI_PROCESS in sqlite.capabilities
    fewer = Durable(memory_app(), pg_url, capabilities=Capability.ALL & ~Capability.EVENTS)
    assert Capability.EVENTS not in fewer.capabilities
    with pytest.raises(Exception, match="capabilities must be a Capability"):
        Durable(memory_app(), pg_url, capabilities="ALL")


def without(capability: Capability) -> Fake:
    fake = Fake(capabilities=Capability.ALL & ~capability)
    return fake


def test_unsupported_key_names_the_capability_and_workflow_and_writes_nothing():
    fake = without(Capability.IDEMPOTENCY_KEY)
    fake.workflow("invoice")(_noop)
    with pytest.raises(Unsupported) as raised:
        fake.start("invoice", key="invoice:order-42")
    assert str(raised.value) == (
        "start: key unsupported by this backend (missing IDEMPOTENCY_KEY): run of workflow 'invoice'"
    )
    assert fake.list_runs() == [] and fake.activity() == []
    fake.start("invoice")  # without a key it is an ordinary run
    assert len(fake.list_runs()) == 1


def test_unsupported_transactions_and_send_event_policy_write_nothing():
    fake = without(Capability.TRANSACTIONS)
    fake.workflow("w")(_noop)
    with fake.db.engine.connect() as conn, pytest.raises(Unsupported) as raised:
        fake.start("w", connection=conn)
    assert "(missing TRANSACTIONS): run of workflow 'w'" in str(raised.value)
    no_events = without(Capability.EVENTS)
    no_events.workflow("w")(_noop)
    holder = no_events.start("w", key="k")
    with pytest.raises(Unsupported, match=r"start: on_duplicate=SendEvent unsupported .*missing EVENTS"):
        no_events.start("w", key="k", on_duplicate=SendEvent("again"))
    with pytest.raises(Unsupported, match=r"send_event: events unsupported .*missing EVENTS.*workflow 'w'"):
        no_events.send_event(holder, "again")
    assert [r.id for r in no_events.list_runs()] == [holder]
    assert no_events.activity(kinds=["key_duplicate"]) == []


def test_unsupported_inside_a_step_fails_the_attempt_with_the_capability_named():
    cases = {
        Capability.WAITS: lambda: current_run().sleep(5),
        Capability.CHILDREN: lambda: current_run().start_workflow("other"),
        Capability.EVENTS: lambda: current_run().wait_for_event("x"),
    }
    for capability, body in cases.items():
        fake = without(capability)
        fake.workflow("other")(_noop)
        wf = fake.workflow("needs")

        @wf.step(retry=1)
        def step(body=body):
            body()

        run_id = fake.start(wf)
        fake.run_until_idle()
        run = fake.get_run(run_id)
        assert run.status == "failed"
        assert run.error["type"] == "Unsupported"
        assert f"(missing {capability.name}): run of workflow 'needs'" in run.error["message"]
        assert [r.workflow for r in fake.list_runs()] == ["needs"]  # no child was written


def test_unsupported_provide_input_and_schedules():
    fake = without(Capability.WAITS)
    fake.workflow("w")(_noop)
    run_id = fake.start("w")
    with pytest.raises(Unsupported, match=r"provide_input: .*missing WAITS.*workflow 'w'"):
        fake.provide_input(run_id, "approval", True)
    no_schedules = without(Capability.SCHEDULES)
    no_schedules.workflow("w")(_noop)
    with pytest.raises(Unsupported, match=r"schedule: schedules unsupported .*missing SCHEDULES.*'w'"):
        no_schedules.schedule("w", "*/5 * * * *", key="k")
    with pytest.raises(Unsupported, match="missing SCHEDULES"):
        no_schedules.beat_entry("w", 60.0, key="k")


def test_unsupported_keys_of_children_and_schedules_write_nothing():
    fake = without(Capability.IDEMPOTENCY_KEY)
    fake.workflow("kid")(_noop)
    wf = fake.workflow("parent")

    @wf.step(retry=1)
    def spawn():
        current_run().call_workflow("kid", key="child-key")

    run_id = fake.start(wf)
    fake.run_until_idle()
    run = fake.get_run(run_id)
    assert run.status == "failed" and run.error["type"] == "Unsupported"
    assert run.error["message"] == (
        "child: key unsupported by this backend (missing IDEMPOTENCY_KEY): run of workflow 'kid'"
    )
    assert [r.workflow for r in fake.list_runs()] == ["parent"]  # no child was written
    with pytest.raises(Unsupported, match=r"schedule: key unsupported .*missing IDEMPOTENCY_KEY.*'kid'"):
        fake.schedule("kid", "*/5 * * * *", key="k")
    with pytest.raises(Unsupported, match=r"beat_entry: key unsupported .*missing IDEMPOTENCY_KEY"):
        fake.beat_entry("kid", 60.0, key="k")
    assert fake.list_schedules() == []
    fake.app.conf.beat_scheduler = "durable_celery.beat:DurableScheduler"
    fake.schedule("kid", "*/5 * * * *", name="unkeyed")  # a schedule without a key is fine
    with pytest.raises(Unsupported, match=r"update_schedule: key unsupported .*missing IDEMPOTENCY_KEY"):
        fake.update_schedule("unkeyed", key="k")
    assert [s.key for s in fake.list_schedules()] == [None]


_FORKED = """
import os, sys
from celery import Celery
from durable_celery import Durable, Unsupported
durable = Durable(Celery("forked", broker="memory://"), "memory://")
def noop():
    pass
durable.workflow("w")(noop)
durable.start("w")
child = os.fork()
if child == 0:
    try:
        durable.start("w")
    except Unsupported as exc:
        print(exc, flush=True)
        os._exit(0)
    os._exit(3)
_, status = os.waitpid(child, 0)
print("child exit", os.waitstatus_to_exitcode(status), "runs", len(durable.list_runs()), flush=True)
"""


def test_memory_store_in_a_forked_process_is_unsupported_and_writes_nothing():
    done = subprocess.run(
        [sys.executable, "-c", _FORKED],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=50,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 2, done.stdout + done.stderr[-2000:]
    assert lines[0].startswith(
        "worker: a forked process unsupported by this backend (missing MULTI_PROCESS): memory://"
    )
    assert lines[1] == "child exit 0 runs 1"  # the parent's store holds only its own run


def test_skip_locked_is_never_refused_and_its_absence_is_named_like_every_capability(tmp_path):
    sqlite = Durable(memory_app(), f"sqlite:///{tmp_path}/file.sqlite3")
    assert Capability.SKIP_LOCKED not in sqlite.capabilities
    sqlite.migrate()
    sqlite.workflow("w")(_noop)
    with worker(sqlite):  # relays and sweeps still share work: they wait for SQLite's write lock
        assert wait_for(sqlite, sqlite.start("w", key="k"), timeout=15).status == "completed"
    for capability in Capability:
        if capability is Capability.ALL:
            continue
        fake = without(capability)
        with pytest.raises(Unsupported) as raised:
            fake.require(capability, "operation", "feature", "w")
        assert str(raised.value) == (
            f"operation: feature unsupported by this backend (missing {capability.name}): run of workflow 'w'"
        )
        fake.require(fake.capabilities, "operation", "feature", "w")  # what it has passes


# -- the Fake --------------------------------------------------------------------------------


def test_fake_runs_steps_only_when_told_and_its_clock_brings_sleeps_and_backoff_due():
    fake = Fake()
    calls = []
    wf = fake.workflow("nap")

    @wf.step(retry=3, backoff=30)
    def first(n):
        calls.append(("first", current_run().attempt))
        if current_run().attempt == 1:
            raise RuntimeError("flaky")
        current_run().sleep(3600)
        return {"n": n + 1}

    @wf.step
    def second(n):
        calls.append(("second", n))
        return n * 10

    run_id = fake.start(wf, {"n": 1})
    assert calls == [] and fake.get_run(run_id).status == "pending"
    assert fake.run_until_idle() == 1  # the first attempt fails and backs off 30 s
    assert fake.get_run(run_id).attempt == 2 and fake.run_until_idle() == 0
    fake.advance(29)
    assert fake.run_until_idle() == 0
    fake.advance(1)
    assert fake.run_until_idle() == 1 and fake.get_run(run_id).status == "waiting"  # asleep
    fake.advance(3599)
    assert fake.run_until_idle() == 0
    fake.advance(1)
    assert fake.run_until_idle() == 2
    run = fake.get_run(run_id)
    assert run.status == "completed" and run.output == 10
    assert calls == [("first", 1), ("first", 2), ("first", 2), ("second", 1)]


def test_fake_debounce_wait_timeouts_and_workflow_timeout_come_due_on_its_clock():
    fake = Fake()
    got = []
    debounced = fake.workflow("search", debounce={"period": 60})

    @debounced.step
    def index(q):
        got.append(q)

    first = fake.start(debounced, {"q": "a"}, key="user:1")
    fake.advance(30)
    assert fake.start(debounced, {"q": "ab"}, key="user:1") == first
    fake.advance(59)
    assert fake.run_until_idle() == 0
    fake.advance(1)
    fake.run_until_idle()
    assert got == ["ab"]

    waits = fake.workflow("approval")

    @waits.step
    def ask():
        return current_run().wait_for_input("ok", timeout=3600)

    asked = fake.start(waits)
    fake.run_until_idle()
    fake.advance(3600)
    fake.run_until_idle()
    assert fake.get_run(asked).error["type"] == "EventTimeout"

    bounded = fake.workflow("bounded", timeout=600)

    @bounded.step
    def park():
        current_run().wait_for_event("never")

    parked = fake.start(bounded)
    fake.run_until_idle()
    fake.advance(601)
    fake.run_until_idle()
    run = fake.get_run(parked)
    assert run.status == "failed" and run.error["type"] == "WorkflowTimeout"


def test_fake_keeps_the_key_rules_run_again_and_cancel_existing():
    fake = Fake()
    wf = fake.workflow("sync", on_duplicate="run_again")

    @wf.step
    def sync(n):
        current_run().wait_for_event("go")
        return n

    holder = fake.start(wf, {"n": 1}, key="acct:1")
    assert fake.start(wf, {"n": 2}, key="acct:1") == holder  # unclaimed: it takes the newer input
    fake.run_until_idle()  # now it holds the key, waiting
    waiting = fake.start(wf, {"n": 3}, key="acct:1")
    assert fake.start(wf, {"n": 4}, key="acct:1") == waiting and waiting != holder
    fake.send_event(holder, "go")
    fake.run_until_idle()
    fake.send_event(waiting, "go")
    fake.run_until_idle()
    assert fake.get_run(holder).output == 2 and fake.get_run(waiting).output == 4
    strict = fake.workflow("strict", on_duplicate="error")
    strict.step(lambda n: n, name="sync")
    held = fake.start(strict, {"n": 1}, key="k")
    with pytest.raises(KeyTaken) as taken:
        fake.start(strict, {"n": 2}, key="k")
    assert taken.value.holder_id == held
    replaced = fake.start(strict, {"n": 2}, key="k", on_duplicate="cancel_existing")
    fake.run_until_idle()
    assert fake.get_run(held).status == "cancelled" and fake.get_run(replaced).output == 2


def test_fake_accepts_workflows_of_the_apps_own_durable(pg_url):
    real = Durable(memory_app("real"), pg_url)
    wf = real.workflow("invoice")

    @wf.step
    def send(n):
        return n + 1

    fake = Fake()
    fake.register(wf)
    run_id = fake.start("invoice", {"n": 1}, key="inv:1")
    fake.run_until_idle()
    assert fake.get_run(run_id).output == 2
    assert real.list_runs() == []  # nothing reached the real database


def test_fake_provides_input_and_runs_workflows_defined_with_durable_workflow(monkeypatch):
    import weakref

    from durable_celery import definition

    # This definition stays out of every other Durable of the process, and this one's out of it.
    monkeypatch.setattr(definition, "_shared", [])
    monkeypatch.setattr(definition, "_live", weakref.WeakSet())
    fake = Fake()

    @durable_workflow(name="approval_flow", key="doc:{doc}")
    def approve(doc):
        answer = current_run().wait_for_input("approval", timeout=3600)
        return {"doc": doc, "approved": answer}

    first = fake.start("approval_flow", {"doc": 7})
    assert fake.start("approval_flow", {"doc": 7}) == first  # its key template holds
    fake.run_until_idle()
    assert fake.get_run(first).status == "waiting"
    fake.provide_input(first, "approval", True)
    assert fake.run_until_idle() == 1
    run = fake.get_run(first)
    assert run.status == "completed" and run.output == {"doc": 7, "approved": True}


def test_fake_advance_checks_its_argument_and_run_until_idle_stops_a_workflow_that_never_idles():
    fake = Fake()
    with pytest.raises(InvalidArgument):
        fake.advance(-1)
    wf = fake.workflow("busy")

    @wf.step
    def spin():
        current_run().snooze(0)

    fake.start(wf)
    with pytest.raises(Exception, match="still not idle after 5 steps"):
        fake.run_until_idle(max_steps=5)


def test_a_user_function_that_takes_a_durable_is_handed_a_fake():
    def place_order(durable: Durable, order_id: str) -> str:
        return durable.start("charge", {"order_id": order_id}, key=f"order:{order_id}")

    fake = Fake()
    charged = []

    @fake.workflow(name="charge")
    def charge(order_id):
        charged.append(order_id)

    assert place_order(fake, "A1") == place_order(fake, "A1")
    fake.run_until_idle()
    assert charged == ["A1"]


# -- eager mode ------------------------------------------------------------------------------


def test_eager_start_runs_the_steps_and_children_inline_until_done_or_waiting():
    durable = Durable(memory_app(task_always_eager=True), "memory://")
    ran = []
    child = durable.workflow("child")

    @child.step
    def twice(n):
        ran.append(("child", threading.get_ident()))
        return n * 2

    wf = durable.workflow("eager")

    @wf.step
    def one(n):
        ran.append(("one", threading.get_ident()))
        return {"n": current_run().call_workflow(child, {"n": n})}

    @wf.step
    def two(n):
        return n + 1

    run_id = durable.start(wf, {"n": 5})
    assert durable.get_run(run_id).status == "completed" and durable.get_run(run_id).output == 6
    assert [(s.name, s.output) for s in durable.list_steps(run_id) if s.status == "completed"] == [
        ("one", {"n": 10}),
        ("two", 6),
    ]
    assert {thread for _, thread in ran} == {threading.get_ident()}

    waits = durable.workflow("waits")

    @waits.step
    def hold():
        return current_run().wait_for_event("go")

    parked = durable.start(waits)
    assert durable.get_run(parked).status == "waiting"


# -- run_context -----------------------------------------------------------------------------


def test_run_context_lets_a_step_be_called_directly():
    def ship(order_id):
        run = current_run()
        run.context["tries"] = run.attempt
        address = run.wait_for_input("address", timeout=86400)
        run.sleep(60)
        label = run.call_workflow("print_label", {"to": address})
        if run.key is None:
            run.snooze(5, "no key")
        return {"order": order_id, "label": label}

    with run_context({"order_id": 7}, key="order:7", attempt=2) as run:
        with pytest.raises(WaitingForInput) as waiting:
            ship(order_id=7)
        assert waiting.value.name == "address" and waiting.value.timeout == 86400
        assert run.context == {"tries": 2}

    with run_context({"order_id": 7}, inputs={"address": "Main St"}) as run:
        with pytest.raises(Sleeping) as sleeping:
            run.call(ship)
        assert sleeping.value.seconds == 60

    done = {"inputs": {"address": "Main St"}, "sleeps_done": 1, "children": {"print_label": "L-1"}}
    with run_context({"order_id": 7}, **done) as run:
        with pytest.raises(Snoozing, match="no key"):
            run.call(ship)
        assert [c.what for c in run.calls] == ["wait_for_input", "sleep", "call_workflow", "snooze"]

    with run_context({"order_id": 7}, key="order:7", **done) as run:
        assert run.call(ship) == {"order": 7, "label": "L-1"}

    with run_context() as run:
        with pytest.raises(CallingWorkflow) as calling:
            run.call_workflow("print_label", {"to": "x"})
        assert calling.value.workflow == "print_label"
        with pytest.raises(WaitingForEvent):
            run.wait_for_event("paid")
    with pytest.raises(Exception, match="only available inside a durable step"):
        current_run()


def test_run_context_calls_a_workflows_step_and_refuses_what_capabilities_lack():
    fake = Fake()
    wf = fake.workflow("steps")

    @wf.step
    def a(n):
        return {"n": n + 1}

    @wf.step
    def b(n):
        return current_run().call_workflow("c", {"n": n})

    with run_context({"n": 1}) as run:
        assert run.call(wf) == {"n": 2}
        with pytest.raises(CallingWorkflow):
            run.call(wf, step="b")
        assert run.step == "b"
    fewer = Capability.ALL & ~Capability.CHILDREN
    refused = pytest.raises(Unsupported, match="missing CHILDREN.*workflow 'steps'")
    with run_context({"n": 1}, workflow="steps", capabilities=fewer) as run, refused:
        run.call(wf, step="b")
    with pytest.raises(InvalidArgument), run_context(attempt=0):
        pass


def test_fake_runs_as_a_worker_for_tests_written_for_one():
    fake = Fake()
    wf = fake.workflow("timed")

    @wf.step
    def nap():
        current_run().sleep(0.2)
        return "rested"

    with worker(fake):
        run_id = fake.start(wf)
        assert wait_for(fake, run_id, timeout=10).output == "rested"
    before = fake.now()
    fake.run_until_idle()
    assert fake.now() == before  # the clock stands still again


def test_child_failure_under_the_fake_reaches_the_parent():
    fake = Fake()
    child = fake.workflow("bad_child")

    @child.step(retry=1)
    def boom():
        raise RuntimeError("no")

    parent = fake.workflow("parent")

    @parent.step(retry=1)
    def call():
        try:
            current_run().call_workflow(child)
        except ChildFailed:
            return "saw it fail"

    run_id = fake.start(parent)
    fake.run_until_idle()
    assert fake.get_run(run_id).output == "saw it fail"
    assert fake.now() - fake.now() == timedelta(0)


def _noop() -> None:
    """A step that does nothing."""


def test_an_eager_duplicate_start_runs_nothing_of_the_holder():
    """Guards issue 33 (bug 1): in eager mode a keyed duplicate returns the holder's id and runs
    none of its due steps in the caller; a duplicate creates nothing and runs nothing."""
    durable = Durable(memory_app(task_always_eager=True), "memory://")
    ran: list[str] = []
    wf = durable.workflow("eager_dup")

    @wf.step
    def nap():
        current_run().sleep(0.2)

    @wf.step
    def after():
        ran.append(current_run().id)

    holder = durable.start(wf, key="k")
    assert durable.get_run(holder).status == "waiting" and ran == []
    time.sleep(0.3)  # the holder's sleep is over: its next step is due now
    assert durable.start(wf, key="k") == holder
    assert ran == []  # the duplicate ran nothing of the holder
    assert durable.get_run(holder).status == "waiting"


def test_key_statistics_follow_the_fakes_clock():
    """Guards issue 33 (bug 3): ``list_keys`` and ``stats.keys`` count re-adds by the store's
    clock, so ``advance`` moves them out of the last day, and out of the week, as time would."""
    fake = Fake()
    wf = fake.workflow("stat_clock", key="k:{n}")
    wf.step(lambda n: n, name="only")
    holder = fake.start(wf, {"n": 1})
    assert fake.start(wf, {"n": 1}) == holder  # one re-add
    (entry,) = fake.list_keys()
    assert entry.readds_last_day == 1 and fake.stats.keys()["readds"] == 1
    fake.advance(3 * 86400)
    (entry,) = fake.list_keys()
    assert entry.readds_last_day == 0 and fake.stats.keys()["readds"] == 1  # kept a week
    fake.advance(5 * 86400)
    assert fake.stats.keys()["readds"] == 0


def test_a_workflow_made_from_a_function_takes_its_steps_options(monkeypatch):
    """Guards issue 33 (bug 6): ``@durable.workflow(retry=3, backoff=...)`` and
    ``@durable_workflow(..., retry=...)`` set the options of the one step they make."""
    import weakref

    from durable_celery import definition

    # The shared definition below stays out of every other Durable of the process.
    monkeypatch.setattr(definition, "_shared", [])
    monkeypatch.setattr(definition, "_live", weakref.WeakSet())
    fake = Fake()
    tries: list[int] = []

    @fake.workflow(retry=3, backoff=0.5)
    def flaky(n):
        tries.append(current_run().attempt)
        if len(tries) < 3:
            raise RuntimeError("not yet")
        return n

    assert (flaky.steps[0].retry, flaky.steps[0].backoff) == (3, 0.5)
    run_id = fake.start(flaky, {"n": 7})
    for _ in range(3):
        fake.run_until_idle()
        fake.advance(1)
    assert fake.get_run(run_id).output == 7 and tries == [1, 2, 3]

    @durable_workflow(name="shared_flaky", retry=2, compensate_retry=1)
    def shared(n):
        return n

    assert (shared.steps[0].retry, shared.steps[0].compensate_retry) == (2, 1)
    from durable_celery import InvalidDefinition

    with pytest.raises(InvalidDefinition, match="retry is the number of attempts"):
        fake.workflow(retry=0)
    named = fake.workflow("named_with_step_options", retry=2)
    with pytest.raises(InvalidDefinition, match="give them to .step"):
        named.step(lambda: None, name="one")


# -- wait_for says why a run is not moving ----------------------------------------------------


def _live_node(durable):
    """The name of a live node once one has written its row."""
    deadline = time.monotonic() + 30
    while not (found := [n for n in durable.list_nodes() if n["queues"]]):
        assert time.monotonic() < deadline, "no worker node wrote its row"
        time.sleep(0.05)
    return found[0]["name"]


@pytest.mark.parametrize("backend", ["postgres"])
def test_wait_for_names_the_queue_no_live_worker_consumes(durable):
    default = durable.app.conf.task_default_queue
    nobody = f"{default}-nobody"
    durable.workflow("report", queue=nobody).step(lambda month: month, name="render")
    with worker(durable):
        node = _live_node(durable)
        run_id = durable.start("report", {"month": "2026-01"})
        with pytest.raises(TimeoutError) as raised:
            wait_for(durable, run_id, timeout=0.5)
    said = str(raised.value)
    assert said.startswith(f"run {run_id} is pending after 0.5s, not ('completed',")
    assert f"no live worker consumes its queue {nobody} (live nodes: {node} consumes {default})" in said
    assert said.endswith(f"start one with -Q {nobody}")


def _flow_wait(durable, run_id):
    from durable_celery.store.flow_reads import run_flow

    with durable.db.engine.connect() as conn:
        return run_flow(conn, run_id).flow_wait


@pytest.mark.parametrize("backend", ["postgres"])
def test_wait_for_says_a_concurrency_limit_holds_the_run(durable):
    entered, go = threading.Event(), threading.Event()
    export = durable.workflow("export", concurrency={"limit": 1, "key": "tenant:{tenant}"})

    @export.step
    def write(tenant, n):
        entered.set()
        assert go.wait(60), "the test never let the step go"

    try:
        with worker(durable, concurrency=2):
            first = durable.start("export", {"tenant": "A", "n": 1})
            assert entered.wait(30)
            second = durable.start("export", {"tenant": "A", "n": 2})
            deadline = time.monotonic() + 30
            while _flow_wait(durable, second) != "slot":  # the worker's claim parks it
                assert time.monotonic() < deadline, "the second run was never parked"
                time.sleep(0.05)
            with pytest.raises(TimeoutError) as raised:
                wait_for(durable, second, timeout=0.2)
            held = "held by flow control: waiting for a concurrency slot (tenant:A, 1 of 1 in use)"
            assert str(raised.value).endswith(f": {held}")
            with pytest.raises(TimeoutError, match=r"its step is running on \S+ \(last heartbeat "):
                wait_for(durable, first, timeout=0.1)
            go.set()
            assert wait_for(durable, second, timeout=30).status == "completed"
    finally:
        go.set()


@pytest.mark.parametrize("backend", ["postgres"])
def test_wait_for_names_workers_without_the_code_and_a_paused_queue(durable):
    from durable_celery.store import node_rows

    default = durable.app.conf.task_default_queue
    durable.workflow("invoice").step(lambda n: n, name="send")
    now = durable.db.utcnow()
    with durable.db.begin() as conn:  # an older build's worker: it has no workflow invoice
        row = {"name": "old@build", "queues": [default], "steps": {"other": ["x"]}, "pid": 1}
        node_rows.insert_node_txn(conn, dict(row, draining=False, started_at=now, seen_at=now))
    run_id = durable.start("invoice", {"n": 1})
    with pytest.raises(TimeoutError) as raised:
        wait_for(durable, run_id, timeout=0.2)
    lacking = (
        f"the live workers consuming its queue {default} (old@build) lack step 'send' of workflow 'invoice'"
    )
    assert str(raised.value).endswith(f": {lacking}")
    durable.pause_queue(default)
    with pytest.raises(TimeoutError, match=f"its queue {default} is paused: resume it"):
        wait_for(durable, run_id, timeout=0.1)


def test_wait_for_a_fake_says_a_retry_waits_out_its_backoff_and_looks_for_no_worker():
    fake = Fake()
    payment = fake.workflow("payment")

    @payment.step(retry=2, backoff=600)
    def charge(card):
        raise RuntimeError(f"card {card} declined")

    run_id = fake.start(payment, {"card": "4242"})
    with pytest.raises(TimeoutError) as raised:
        wait_for(fake, run_id, timeout=0.1)
    said = str(raised.value)
    assert re.search(r": due since \d\d:\d\d:\d\d UTC on queue \S+, not claimed yet$", said), said
    assert "no live worker" not in said  # a Fake's steps run in the test's thread
    fake.run_until_idle()
    with pytest.raises(TimeoutError) as raised:
        wait_for(fake, run_id, timeout=0.1)
    said = str(raised.value)
    assert (
        "waiting out a retry backoff: attempt 1 of step charge failed (RuntimeError: card 4242 declined)"
        in said
    )
    assert re.search(r"attempt 2 of 2 is due at (\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d UTC$", said), said
