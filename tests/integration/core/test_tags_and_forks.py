"""Tags and forks (issue 43): a run's tags are kept, checked and carried to its children, reruns
and forks; ``fork`` starts a finished run again at a chosen step on today's definition, with the
context that step found or a given one, running none of the steps before it. Real PostgreSQL
and SQLite; steps run through ``run_message`` (as a worker runs a message) in the test's thread."""

from __future__ import annotations

from typing import Any

import pytest

from durable_celery import current_run
from durable_celery.errors import InvalidStart, KeyTaken, NotFinished
from durable_celery.testing import worker

pytestmark = pytest.mark.timeout(90)


def _run_all(durable: Any, run_id: str) -> str:
    """Run the run's steps in this thread until it ends; its status."""
    for _ in range(20):
        run = durable.get_run(run_id)
        if run.finished:
            return str(run.status)
        durable.run_message(run.workflow, run.step_index, run_id)
    raise AssertionError(f"run {run_id} did not end")


def test_tags_are_kept_and_bad_ones_refused_before_anything_is_written(durable: Any) -> None:
    wf = durable.workflow("tagged")
    wf.step(lambda: None, name="only")
    run_id = durable.start(wf, tags={"tenant": "acme", "order": "7"})
    assert durable.get_run(run_id).tags == {"tenant": "acme", "order": "7"}
    assert durable.get_run(durable.start(wf)).tags == {}
    for bad, says in [
        ({"tenant": 7}, "a value is a str"),
        ({"": "x"}, "a tag's name"),
        ({"t" * 65: "x"}, "a tag's name"),
        ({"tenant": "x" * 201}, "a value is a str"),
        ({f"t{n}": "x" for n in range(21)}, "at most 20 tags"),
        (["tenant"], "mapping of str to str"),
    ]:
        with pytest.raises(InvalidStart, match=says):
            durable.start(wf, tags=bad)
    assert len(durable.list_runs(workflow="tagged")) == 2  # the refused starts wrote nothing


def test_children_and_reruns_carry_the_tags(durable: Any) -> None:
    child = durable.workflow("child")
    child.step(lambda n: n + 1, name="inc")
    parent = durable.workflow("parent")

    @parent.step
    def call(n: int) -> int:
        return int(current_run().call_workflow("child", {"n": n}))

    run_id = durable.start(parent, {"n": 1}, tags={"tenant": "acme"})
    with worker(durable):
        assert durable.result(run_id, timeout=30) == 2
    (kid,) = durable.list_children(run_id)
    assert durable.get_run(kid.id).tags == {"tenant": "acme"}
    again = durable.rerun(run_id)
    assert durable.get_run(again).tags == {"tenant": "acme"}


def _five_steps(durable: Any, calls: list[str]) -> Any:
    """A five-step workflow; ``third`` fails unless the context says the address was fixed."""
    wf = durable.workflow("five", key="five:{order}", reuse="never")

    def step(name: str) -> Any:
        def body(order: int) -> str:
            calls.append(name)
            current_run().context[name] = f"{name} done"
            if name == "third" and current_run().context.get("address") != "fixed":
                raise ValueError("bad address")
            return name

        body.__name__ = name
        return body

    for name in ("first", "second", "third", "fourth", "fifth"):
        wf.step(step(name), name=name)
    return wf


def test_a_fork_from_the_failed_step_runs_none_before_it_and_takes_the_corrected_context(
    durable: Any,
) -> None:
    calls: list[str] = []
    wf = _five_steps(durable, calls)
    original = durable.start(wf, {"order": 1}, tags={"tenant": "acme"})
    assert _run_all(durable, original) == "failed"
    assert calls == ["first", "second", "third"]
    before = durable.get_run(original)
    found = {"first": "first done", "second": "second done"}  # what step three found
    assert before.context == found
    with pytest.raises(KeyTaken):  # reuse="never": the original keeps its key
        durable.fork(original, "third")
    calls.clear()
    forked = durable.fork(original, "third", context={**found, "address": "fixed"}, key=None)
    fork = durable.get_run(forked)
    assert (fork.forked_from, fork.step_index, fork.key, fork.tags) == (original, 2, None, {"tenant": "acme"})
    assert _run_all(durable, forked) == "completed"
    assert calls == ["third", "fourth", "fifth"]  # steps one and two are not run again
    assert durable.get_run(forked).context == {
        **found,
        "address": "fixed",
        "third": "third done",
        "fourth": "fourth done",
        "fifth": "fifth done",
    }
    assert durable.get_run(original) == before  # the original is untouched
    assert [s.name for s in durable.list_steps(forked)] == ["third", "fourth", "fifth"]
    entry = durable.activity(kinds=["forked"], run_id=original)[0]
    assert entry.details["fork"] == forked and entry.details["from_step"] == "third"


def test_a_fork_without_a_context_starts_with_the_one_its_step_found(durable: Any) -> None:
    calls: list[str] = []
    wf = _five_steps(durable, calls)
    original = durable.start(wf, {"order": 2})
    assert _run_all(durable, original) == "failed"
    forked = durable.fork(original, 1, key="five:2-again")  # from "second", by index
    assert durable.get_run(forked).context == {"first": "first done"}  # as "second" found it
    from_first = durable.fork(original, "first", key=None)
    assert durable.get_run(from_first).context == {}


def test_a_fork_is_refused_for_a_step_that_is_gone_and_for_a_run_still_going(durable: Any) -> None:
    calls: list[str] = []
    wf = _five_steps(durable, calls)
    going = durable.start(wf, {"order": 3})
    with pytest.raises(NotFinished):
        durable.fork(going, "third")
    assert _run_all(durable, going) == "failed"
    with pytest.raises(InvalidStart, match="has no step 'sixth' now"):
        durable.fork(going, "sixth", key=None)
    with pytest.raises(InvalidStart, match="never ran step 'fifth'"):
        durable.fork(going, "fifth", key=None)  # its context is not known: give context=
    assert durable.get_run(durable.fork(going, "fifth", context={"x": "y"}, key=None)).context == {"x": "y"}


def test_list_runs_filters_by_tags_time_error_type_and_key_prefix(durable: Any) -> None:
    from datetime import timedelta

    from sqlalchemy import update

    from durable_celery.errors import InvalidArgument
    from durable_celery.store.schema import runs

    wf = durable.workflow("listed", key="order:{n}")

    @wf.step
    def go(n: int) -> None:
        if n % 2:
            raise ConnectionError("down") if n % 3 else TimeoutError("slow")

    made = {}
    for n in range(6):
        made[n] = durable.start(wf, {"n": n}, tags={"tenant": "acme" if n < 3 else "globex", "n": str(n)})
        durable.run_message("listed", 0, made[n])
    now = durable.db.utcnow()
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == made[0]).values(created_at=now - timedelta(days=2)))

    def ids(**filters: Any) -> set[int]:
        return {n for n, run_id in made.items() if run_id in {r.id for r in durable.list_runs(**filters)}}

    assert ids(tags={"tenant": "acme"}) == {0, 1, 2}
    assert ids(tags={"tenant": "acme", "n": "1"}) == {1}
    assert ids(tags={"tenant": "nobody"}) == set()
    assert ids(since=now - timedelta(days=1)) == {1, 2, 3, 4, 5}
    assert ids(until=now - timedelta(days=1)) == {0}
    assert ids(error_type="ConnectionError") == {1, 5}
    assert ids(error_type="TimeoutError", status="failed") == {3}
    assert ids(key_prefix="order:") == set(made) and ids(key_prefix="order:1") == {1}
    assert ids(key_prefix="order_") == set()  # "_" is a character, not a wildcard
    with pytest.raises(InvalidArgument, match="timezone"):
        durable.list_runs(since=now.replace(tzinfo=None))
    with pytest.raises(InvalidArgument, match="unknown status"):
        durable.list_runs(status="lost")
