"""Reading keys exactly: the key listing (newest first, by workflow, by a prefix matched
literally, with a limit, page by page after a key's cursor, ties in time included), the
per-status counts, what a hand-off moves, and a new key's start in one statement on PostgreSQL;
on both backends. Written against mutants of durable_celery/store/key_rows.py that the behaviour
tests let through."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update

from durable_celery.errors import InvalidArgument
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


# -- pages (keyset: after= the cursor of a page's last key) ----------------------------------------


@pytest.fixture
def together(durable):
    """Twelve keys of two workflows, started in one transaction: on PostgreSQL they share its
    time (now()), so only the tie-break, workflow then key, descending, orders them."""
    a, b = _workflow(durable, "wf_a"), _workflow(durable, "wf_b")
    numbers = (1, 2, 3, 10, 11, 12)
    names = [("wf_a", f"k{n:02}") for n in numbers] + [("wf_b", f"k{n:02}") for n in numbers]
    with durable.db.begin() as conn:
        for workflow, key in names:
            durable.start(a if workflow == "wf_a" else b, key=key, connection=conn)
    return names


@pytest.fixture
def tied(durable, together):
    """The twelve keys given three times: 7 keys of both workflows at the newest, 1 alone, 4 at
    the oldest; the order is total only by the tie-break."""
    names = together
    at = {
        "new": durable.db.utcnow().replace(year=2021, month=6, day=1, microsecond=123456),
        "mid": durable.db.utcnow().replace(year=2021, month=5, day=1, microsecond=0),
        "old": durable.db.utcnow().replace(year=2021, month=4, day=1, microsecond=654321),
    }
    when = {pair: "new" for pair in names[:4] + names[6:9]} | {names[4]: "mid"}
    with durable.db.begin() as conn:
        for workflow, key in names:
            taken = at[when.get((workflow, key), "old")]
            conn.execute(
                update(keys).where(keys.c.workflow == workflow, keys.c.key == key).values(taken_at=taken)
            )
    return sorted(names, key=lambda pair: (at[when.get(pair, "old")], *pair), reverse=True)


def _walk(durable: Any, size: int, **filters: Any) -> list[tuple[str, str]]:
    """Every page of ``size`` keys, each after the cursor of the page before, to the end."""
    seen: list[tuple[str, str]] = []
    page = durable.list_keys(limit=size, **filters)
    while page:
        assert len(page) <= size
        seen += [(k.workflow, k.key) for k in page]
        page = durable.list_keys(limit=size, after=page[-1].cursor, **filters)
    return seen


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite's clock moves between statements
def test_pages_of_keys_taken_in_one_transaction_go_by_workflow_and_key(durable, together):
    listed = durable.list_keys()
    assert len({k.taken_at for k in listed}) == 1  # one time: the transaction's
    assert [(k.workflow, k.key) for k in listed] == sorted(together, reverse=True)
    for size in (1, 2, 5):
        assert _walk(durable, size) == sorted(together, reverse=True)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 12])
def test_pages_of_keys_walked_to_the_end_give_every_key_once_in_order(durable, tied, size):
    assert [(k.workflow, k.key) for k in durable.list_keys()] == tied
    assert _walk(durable, size) == tied


def test_pages_of_keys_keep_the_workflow_and_the_prefix(durable, tied):
    assert _walk(durable, 2, workflow="wf_a") == [p for p in tied if p[0] == "wf_a"]
    assert _walk(durable, 2, prefix="k0") == [p for p in tied if p[1].startswith("k0")]
    assert _walk(durable, 2, workflow="wf_b", prefix="k1") == [
        ("wf_b", "k12"),
        ("wf_b", "k11"),
        ("wf_b", "k10"),
    ]
    assert _walk(durable, 2, workflow="wf_none") == []


def test_a_key_s_cursor_carries_when_it_was_taken(durable, tied):
    from durable_celery.observe.activity import KeyEntry
    from durable_celery.paging import check_key_cursor

    first = durable.list_keys(limit=1)[0]
    assert first.taken_at is not None and first.taken_at.tzinfo is not None
    taken = first.taken_at
    assert (taken.year, taken.month, taken.day, taken.microsecond) == (2021, 6, 1, 123456)
    assert check_key_cursor(first.cursor) == (first.taken_at, first.workflow, first.key)
    assert KeyEntry("wf", "k", "id", "pending", None, 0, 0).cursor is None  # no taken_at, no cursor


@pytest.mark.parametrize(
    "bad",
    [
        "",  # empty
        "not a cursor!",  # not base64
        "x",  # not whole base64
        "e30",  # {}: not a list
        "WyJ4IiwiYSIsImIiXQ",  # ["x","a","b"]: not a time
        "WyIyMDIxLTA2LTAxVDAwOjAwOjAwKzAwOjAwIiwid2ZfYSJd",  # two items, not three
        "a" * 3000,  # too long
        42,
        ("2021-06-01", "wf_a", "k01"),
    ],
)
def test_a_bad_key_cursor_is_an_invalid_argument(durable, tied, bad):
    with pytest.raises(InvalidArgument, match="cursor of the last key"):
        durable.list_keys(after=bad)
