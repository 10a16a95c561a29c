"""``durable flow``: each flow limit's use per key (text, ``--json``, ``--workflow``), through a
real ``celery -A ... durable`` process on PostgreSQL, with runs parked by the engine's claim."""

from __future__ import annotations

import json
import threading

import pytest

from durable_celery.store.schema import runs
from tests.integration.helpers import cli_app

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("backend", ["postgres"])]


# Defined alike in the test and in the app the CLI loads: the report reads the limits defined.
DEFINE = """
import threading

GO = threading.Event()
ENTERED = threading.Event()


def define(durable):
    sync = durable.workflow("sync", concurrency={"limit": 1, "key": "tenant:{tenant}"})

    @sync.step
    def fetch(tenant, n):
        ENTERED.set()
        assert GO.wait(60), "the test never let the step go"

    api = durable.workflow(
        "api",
        throttle={"limit": 1, "period": 60, "key": "api:{customer}"},
        rate_limit={"limit": 3, "period": 3600},
    )
    api.step(lambda customer, n: n, name="call")
    durable.workflow("plain").step(lambda: None, name="only")
    fair = durable.workflow("fair", concurrency={"limit": 1, "fair": "t:{tenant}", "weights": {"t:gold": 3}})
    fair.step(lambda tenant, n: n, name="work")
    invoice = durable.workflow("invoice", batch={"max": 5, "period": 60, "key": "invoice:{customer}"})
    invoice.step(lambda items: len(items), name="bill")
"""


@pytest.fixture
def cli(durable, tmp_path):
    return cli_app(durable, tmp_path, "flowapp", DEFINE, ("flow",))


@pytest.fixture
def parked(durable):
    """sync: tenant:A's one slot held by a step running in a thread, a second run parked for
    it; api: api:c1 begun once in its 60 s window, a second run parked by the throttle."""
    namespace: dict = {}
    exec(DEFINE, namespace)
    namespace["define"](durable)
    sync, api = durable.workflows["sync"], durable.workflows["api"]
    holder = durable.start("sync", {"tenant": "A", "n": 1})
    waiting = durable.start("sync", {"tenant": "A", "n": 2})
    runner = threading.Thread(target=durable.engine.execute, args=(sync, sync.steps[0], holder, False))
    runner.start()
    try:
        assert namespace["ENTERED"].wait(30)
        assert durable.engine.execute(sync, sync.steps[0], waiting, False) == "dropped"
        calls = [durable.start("api", {"customer": "c1", "n": n}) for n in range(2)]
        outcomes = [durable.engine.execute(api, api.steps[0], run_id, False) for run_id in calls]
        assert outcomes == ["completed", "dropped"]
        yield {"waiting": waiting, "throttled": calls[1]}
    finally:
        namespace["GO"].set()
        runner.join(30)


def test_flow_prints_each_limit_per_key_aligned(cli, parked):
    out = cli()
    lines = out.splitlines()
    assert "plain" not in out  # no limit, not listed
    assert lines[0] == (
        "api: throttle 1 begin per 60s per api:{customer}; "
        "rate_limit 3 starts per 3600s for the whole workflow"
    )
    header = lines[1]
    assert header.split() == ["limit", "key", "use", "waiting", "again", "at", "oldest", "waiting", "start"]
    throttle = next(line for line in lines if line.strip().startswith("throttle"))
    assert throttle.split()[:9] == ["throttle", "api:c1", "1", "of", "1", "begun", "in", "60s", "1"]
    rate = next(line for line in lines if line.strip().startswith("rate_limit"))
    assert "the whole workflow" in rate and "2 of 3 started in 3600s" in rate
    # Columns line up under the header.
    for line in (throttle, rate):
        assert line.index("of ") - len("1 ") == header.index("use")
        assert line.rstrip()[header.index("waiting") : header.index("waiting") + 7].strip() in ("1", "-")
    sync_at = lines.index(next(line for line in lines if line.startswith("sync:")))
    assert lines[sync_at] == "sync: concurrency 1 at once per tenant:{tenant}"
    assert lines[sync_at - 1] == ""
    slot = lines[sync_at + 2].split()
    assert slot[:8] == ["concurrency", "tenant:A", "1", "of", "1", "in", "use", "1"]


def test_flow_json_and_one_workflow(cli, parked):
    found = [json.loads(line) for line in cli("--workflow", "sync", "--json").splitlines()]
    assert len(found) == 1
    (entry,) = found
    assert entry["workflow"] == "sync" and entry["limits"] == {
        "concurrency": {"limit": 1, "key": "tenant:{tenant}"}
    }
    assert (entry["kind"], entry["key"], entry["used"], entry["limit"], entry["waiting"]) == (
        "concurrency",
        "tenant:A",
        1,
        1,
        1,
    )
    assert entry["oldest_waiting"] is not None
    api = [json.loads(line) for line in cli("-w", "api", "--json").splitlines()]
    assert {(e["kind"], e["key"]) for e in api} == {("throttle", "api:c1"), ("rate_limit", "")}
    (throttle,) = [e for e in api if e["kind"] == "throttle"]
    assert throttle["next_look"] is not None and throttle["waiting"] == 1
    assert "no workflow defined here has a concurrency" in cli("-w", "plain")


def test_flow_refuses_an_unknown_workflow_and_has_help(cli):
    out = cli("--workflow", "nope", code=1)
    assert "no workflow 'nope' is defined here" in out
    assert "one of api, fair, invoice, plain, sync" in out
    text = cli("--help")
    assert "--workflow NAME" in text and "--json" in text and "concurrency: slots in use" in text
    assert "api: throttle 1 begin per 60s" in cli()  # no run yet: the limits, nothing in use
    assert "  nothing in use" in cli("-w", "sync")


def test_flow_shows_each_fair_keys_share_and_the_held_priorities(cli, durable):
    namespace: dict = {}
    exec(DEFINE, namespace)
    namespace["define"](durable)
    fair = durable.workflows["fair"]
    holder = durable.start("fair", {"tenant": "gold", "n": 0})
    with durable.db.begin() as conn:  # a worker executes its step: it holds the slot
        conn.execute(
            runs.update()
            .where(runs.c.id == holder)
            .values(status="running", locked_by="alive:1:1", heartbeat_at=durable.db.utcnow())
        )
    parked = durable.start("fair", {"tenant": "gold", "n": 1})
    assert durable.engine.execute(fair, fair.steps[0], parked, False) == "dropped"
    durable.start("fair", {"tenant": "free", "n": 1}, priority=2)  # parked at its start
    lines = cli("-w", "fair").splitlines()
    assert lines[0] == "fair: concurrency 1 at once for the whole workflow, shared fairly by t:{tenant}"
    shares = [line.split() for line in lines if line.strip().startswith("fair ")]
    assert [s[:10] for s in shares] == [
        ["fair", "t:free", "weight", "1", "0", "in", "use", "(0%)", "1", "waiting"],
        ["fair", "t:gold", "weight", "3", "1", "in", "use", "(100%)", "1", "waiting"],
    ]
    assert "  held by priority: 2: 1, 0: 1" in lines
    found = [json.loads(line) for line in cli("-w", "fair", "--json").splitlines()]
    assert [(e.get("kind"), e.get("key"), e.get("waiting")) for e in found if e.get("kind") == "fair"] == [
        ("fair", "t:free", 1),
        ("fair", "t:gold", 1),
    ]
    assert {"workflow": "fair", "kind": "priorities", "held": {"2": 1, "0": 1}} in found


def test_flow_shows_open_batches(cli, durable):
    namespace: dict = {}
    exec(DEFINE, namespace)
    namespace["define"](durable)
    assert cli("-w", "invoice").splitlines()[1:] == ["  no batch open"]
    first = durable.start("invoice", {"customer": 1})
    durable.start("invoice", {"customer": 1})
    lines = cli("-w", "invoice").splitlines()
    assert lines[0] == "invoice: batch up to 5 starts a run, gathered for 60s per invoice:{customer}"
    words = lines[1].split()
    assert words[:6] == ["batch", "invoice:1", "2", "of", "5", "items"] and words[-2:] == ["run", first]
    found = [json.loads(line) for line in cli("-w", "invoice", "--json").splitlines()]
    batches = [e for e in found if e.get("kind") == "batch"]
    assert [(b["key"], b["run_id"], b["items"], b["max"]) for b in batches] == [("invoice:1", first, 2, 5)]
