"""Reading keys exactly: the key listing (newest first, by workflow, by a prefix matched
literally, with a limit), the per-status counts, what a hand-off moves, and a new key's start in
one statement on PostgreSQL; on both backends. Written against mutants of
durable_celery/store/key_rows.py that the behaviour tests let through."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update

from durable_celery.store.schema import keys, runs

pytestmark = pytest.mark.timeout(60)


def _workflow(durable: Any, name: str) -> Any:
    wf = durable.workflow(name)

    @wf.step
    def only():
        return None

    return wf


def _age(durable: Any, order: list[tuple[str, str]]) -> None:
    """Make the key rows' taken_at follow ``order`` (workflow, key), oldest first."""
    with durable.db.begin() as conn:
        for minutes, (workflow, key) in enumerate(order):
            taken = durable.db.utcnow().replace(year=2020, month=1, day=1, hour=0, minute=minutes)
            conn.execute(
                update(keys).where(keys.c.workflow == workflow, keys.c.key == key).values(taken_at=taken)
            )


def _status(durable: Any, run_id: str, status: str) -> None:
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(status=status))


@pytest.fixture
def held(durable):
    """Two workflows' keys, some sharing a prefix, taken in a known order; one holder finished."""
    a, b = _workflow(durable, "wf_a"), _workflow(durable, "wf_b")
    ids = {
        ("wf_a", "article:1"): durable.start(a, key="article:1"),
        ("wf_a", "Article:2"): durable.start(a, key="Article:2"),
        ("wf_a", "art_x"): durable.start(a, key="art_x"),
        ("wf_b", "article:3"): durable.start(b, key="article:3"),
        ("wf_b", "other"): durable.start(b, key="other"),
    }
    _age(durable, list(ids))
    _status(durable, ids[("wf_b", "other")], "completed")
    return ids


def test_keys_are_listed_newest_first_with_their_holder_and_its_status(durable, held):
    listed = durable.list_keys()
    assert [(k.workflow, k.key) for k in listed] == list(reversed(list(held)))
    assert [k.holder_id for k in listed] == [held[(k.workflow, k.key)] for k in listed]
    statuses = {(k.workflow, k.key): k.holder_status for k in listed}
    assert statuses.pop(("wf_b", "other")) == "completed"
    assert set(statuses.values()) == {"pending"}
    assert all(k.waiting_id is None for k in listed)


def test_the_limit_keeps_the_newest(durable, held):
    newest = [(k.workflow, k.key) for k in durable.list_keys(limit=2)]
    assert newest == [("wf_b", "other"), ("wf_b", "article:3")]


def test_a_workflow_lists_only_its_own_keys(durable, held):
    assert [k.key for k in durable.list_keys("wf_a")] == ["art_x", "Article:2", "article:1"]
    assert [k.key for k in durable.list_keys("wf_b")] == ["other", "article:3"]
    assert durable.list_keys("wf_none") == []


def test_a_prefix_matches_exactly_case_and_wildcards_included(durable, held):
    assert [k.key for k in durable.list_keys(prefix="article:")] == ["article:3", "article:1"]
    assert [k.key for k in durable.list_keys("wf_a", prefix="article")] == ["article:1"]
    assert [k.key for k in durable.list_keys(prefix="Art")] == ["Article:2"]
    assert [k.key for k in durable.list_keys(prefix="art_")] == ["art_x"]  # "_" is no wildcard
    assert durable.list_keys(prefix="art%") == []
    assert durable.list_keys(prefix="article:1x") == []


def test_keys_held_are_counted_per_holder_status(durable, held):
    stats = durable.stats.keys()
    assert (stats["keys_held"], stats["blocking"]) == (5, 4)  # the completed holder frees its key
    stats = durable.stats.keys(workflow="wf_b")
    assert (stats["keys_held"], stats["blocking"]) == (2, 1)
    stats = durable.stats.keys(workflow="wf_a")
    assert (stats["keys_held"], stats["blocking"]) == (3, 3)


def test_a_hand_off_moves_only_its_own_key_and_makes_it_the_newest(durable, held):
    wf = durable.workflows["wf_a"]
    freed = held[("wf_a", "article:1")]  # the oldest key
    _status(durable, freed, "completed")
    new = durable.start(wf, key="article:1")
    assert new != freed
    listed = durable.list_keys()
    assert (listed[0].workflow, listed[0].key, listed[0].holder_id) == ("wf_a", "article:1", new)
    others = {(k.workflow, k.key): k.holder_id for k in listed[1:]}
    assert others == {pair: run_id for pair, run_id in held.items() if pair != ("wf_a", "article:1")}


def test_a_hand_off_leaves_the_same_key_of_another_workflow_alone(durable):
    a, b = _workflow(durable, "wf_a"), _workflow(durable, "wf_b")
    first_a, first_b = durable.start(a, key="k"), durable.start(b, key="k")
    _status(durable, first_a, "completed")
    second_a = durable.start(a, key="k")
    holders = {(k.workflow, k.key): k.holder_id for k in durable.list_keys()}
    assert holders == {("wf_a", "k"): second_a, ("wf_b", "k"): first_b}


def test_a_run_waits_behind_its_own_key_only(durable):
    wf = durable.workflow("waits", on_duplicate="run_again")

    @wf.step
    def only(n=0):
        return n

    holder, other = durable.start(wf, key="k"), durable.start(wf, key="k2")
    for run_id in (holder, other):
        with durable.db.begin() as conn:
            conn.execute(update(runs).where(runs.c.id == run_id).values(status="running", started_at=None))
    waiting = durable.start(wf, {"n": 1}, key="k")
    waits = {k.key: k.waiting_id for k in durable.list_keys("waits")}
    assert waits == {"k": waiting, "k2": None}


def _statements(durable: Any) -> list[str]:
    from sqlalchemy import event

    seen: list[str] = []

    @event.listens_for(durable.db.engine, "before_cursor_execute")
    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement.split(None, 1)[0].upper())

    return seen


@pytest.mark.parametrize("backend", ["postgres"])
@pytest.mark.parametrize("policy", ["use_existing", "error", "run_again"])
def test_a_start_of_a_new_key_is_one_statement_on_postgresql(durable, policy):
    """The key row and the run in one autocommit statement, whatever the policy; a duplicate
    under use_existing is answered in one statement too (start_or_answer, insert_run_with_key)."""
    wf = durable.workflow(f"one_{policy}", on_duplicate=policy)
    wf.step(lambda: None, name="only")
    durable.start(wf, key="warm")  # the pool's first connection and its setup are not counted
    statements = _statements(durable)
    holder = durable.start(wf, key="new")
    assert len(statements) == 1, statements
    assert durable.get_run(holder).status == "pending"
    if policy == "use_existing":
        statements.clear()
        assert durable.start(wf, key="new") == holder
        assert len(statements) == 1, statements
        (entry,) = durable.activity(kinds=["key_duplicate"], run_id=holder)
        assert entry.details["outcome"] == "use_existing"
