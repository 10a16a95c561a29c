"""The figures docs/production.md and bench/README.md show about what a run costs are what
``python -m bench.run_cost`` measures.

They sit in blocks between ``<!-- bench.run_cost: NAME -->`` and ``<!-- /bench.run_cost: DIGEST
-->``, written by ``python -m bench.run_cost --write-docs``. A block whose text no longer matches
its digest was edited by hand. Then the script measures on a scratch database of its own (300
no-op runs, 10 per 100 KB case): statements, rows written and dead row versions per run must be
what the docs say, bytes within ``run_cost.TOLERANCE`` (fewer runs than that and page
granularity alone moves bytes per run by more).
"""

from __future__ import annotations

from datetime import date

import pytest

from bench import run_cost
from tests.conftest import PG_HOST

RUNS, INPUT_RUNS = 300, 10
WHERE = {  # which blocks each document has
    "production.md": {"cost", "payloads", "inputs"},
    "README.md": {"cost"},
}
FIX = f"run `{run_cost.COMMAND}` rather than editing a figure"


def blocks() -> list[tuple[str, str, str, str | None]]:
    """Every block of the docs: (document, name, body, digest of its closing marker)."""
    return [(path.name, *block) for path in run_cost.DOCS for block in run_cost.read_blocks(path.read_text())]


def test_the_docs_have_their_blocks_as_the_script_wrote_them():
    found = blocks()
    for document, names in WHERE.items():
        assert {name for where, name, _, _ in found if where == document} == names, document
    for document, name, body, digest in found:
        assert digest == run_cost.digest(name, body), f"{document}: block {name!r} was edited by hand; {FIX}"
    bodies: dict[str, set[str]] = {}
    for _, name, body, _ in found:
        bodies.setdefault(name, set()).add(body)
    assert all(len(same) == 1 for same in bodies.values()), "blocks of one name differ: " + FIX


def figures() -> run_cost.Figures:
    """Made-up figures, shaped as a measurement's."""
    tables = {t: dict.fromkeys(run_cost.FIELDS, 0.0) for t in run_cost.TABLES}
    tables["durable_runs"].update(n_tup_ins=1, n_tup_upd=4, n_dead_tup=4, total=700.0)
    tables["durable_steps"].update(n_tup_ins=3, total=900.0)
    return run_cost.Figures(
        runs=RUNS,
        input_runs=INPUT_RUNS,
        postgres="PostgreSQL 15",
        statements={"INSERT": 1.0, "UPDATE": 1.0, "WITH": 3.0},
        keyed={"INSERT": 1.0, "SELECT": 1.0, "UPDATE": 2.0, "WITH": 3.0},
        tables=tables,
        live={"durable_runs": 192.0, "durable_steps": 462.0},
        payloads={
            "id": {"disk": 1700.0, "live": 774.0},
            "document": {"disk": 425000.0, "live": 200670.0},
            "logs": {"disk": 3800.0, "live": 2004.0},
        },
        inputs={
            "plain": {"durable_runs": 105000.0, "durable_steps": 800.0, "durable_activity": 0.0},
            "duplicates": {"durable_runs": 105000.0, "durable_steps": 800.0, "durable_activity": 14000.0},
        },
    )


def test_what_a_block_shows_reads_back_and_a_changed_figure_is_told():
    made = figures()
    flat = made.flat()
    for name, body in run_cost.render(made, date(2026, 12, 3)).items():
        shown = run_cost.read_figures(name, body)
        assert shown == {key: round(flat[key]) for key in shown}
        assert run_cost.compare(shown, flat) == []
    assert flat["cost.statements"] == 5 and flat["cost.rows_written"] == 8 and flat["cost.dead"] == 4
    shown = {"cost.statements": 4.0, "cost.dead": 4.0, "cost.disk": 1000.0, "cost.live": 700.0}
    assert [p.split(":")[0] for p in run_cost.compare(shown, flat)] == ["cost.statements", "cost.disk"]


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_figures_in_the_docs_are_what_the_script_measures(redis_server):
    measured = run_cost.measure(RUNS, 1, redis_server, PG_HOST, INPUT_RUNS).flat()
    problems = [
        f"{document} ({name}) {problem}"
        for document, name, body, _ in blocks()
        for problem in run_cost.compare(run_cost.read_figures(name, body), measured)
    ]
    assert not problems, "\n".join([*problems, FIX.capitalize()])
