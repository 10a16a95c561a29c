"""What a ``testing.Fake`` runs next: what is due, oldest due first (the id decides between
runs as due), and not a paused queue's runs, finished runs, another build's workflows or runs
another worker holds. Written against mutants of durable_celery/store/queries.py that the
behaviour tests let through."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.integration.helpers import one_step, set_run

pytestmark = pytest.mark.timeout(60)


def test_a_fake_runs_what_is_due_oldest_due_first_and_leaves_the_rest():
    from durable_celery.testing import Fake

    fake = Fake()
    order: list[str] = []
    wf = fake.workflow("noted")

    @wf.step
    def note(tag):
        order.append(tag)

    ids = {tag: fake.start(wf, {"tag": tag}) for tag in ["a", "b", "c", "d", "e"]}
    # Runs started in the same millisecond have ids in random order: a's sorts last here.
    set_run(fake, ids["a"], id="ffffffff" + ids["a"][8:])
    ids["a"] = "ffffffff" + ids["a"][8:]
    now = fake.db.utcnow()
    set_run(fake, ids["d"], due_at=now - timedelta(seconds=20))
    set_run(fake, ids["b"], due_at=now - timedelta(seconds=10))
    set_run(fake, ids["a"], due_at=now - timedelta(seconds=5))
    set_run(fake, ids["c"], due_at=now - timedelta(seconds=5))  # as due as a: the id decides
    set_run(fake, ids["e"], due_at=now - timedelta(seconds=30), locked_by="another-worker:1")
    assert fake.run_until_idle() == 4
    assert order == ["d", "b", "c", "a"]  # the locked one is another worker's
    fake.close()


def test_a_fake_leaves_paused_queues_finished_runs_and_other_workflows_alone():
    from durable_celery.testing import Fake

    fake = Fake()
    ran: list[str] = []
    wf = fake.workflow("kept", queue="slow")

    @wf.step
    def note(tag):
        ran.append(tag)

    paused = fake.start(wf, {"tag": "paused"})
    fake.pause_queue("slow")
    assert fake.run_until_idle() == 0
    stray = fake.start(one_step(fake, "stray"))
    set_run(fake, stray, workflow="not_defined_here")  # another build's workflow on the store
    done = fake.start(one_step(fake, "done"))
    set_run(fake, done, status="cancelled", finished_at=fake.db.utcnow())  # its due_at left behind
    assert fake.run_until_idle() == 0
    fake.resume_queue("slow")
    assert fake.run_until_idle() == 1 and ran == ["paused"]
    assert fake.get_run(paused).status == "completed"
    fake.close()


def test_a_fake_runs_one_step_per_step_message_its_task_is_handed():
    """Guards mutants of durable_celery/core/engine.py: steps run in the calling thread run one
    at a time, as ``run_until_idle`` hands them out, even when a step's Celery task is called
    with a queue (a worker's inline continuation is off)."""
    from durable_celery.testing import Fake

    fake = Fake()
    wf = fake.workflow("stepwise")
    wf.step(lambda: 1, name="first")
    wf.step(lambda: 2, name="second")
    run_id = fake.start(wf)

    queue = fake.app.conf.task_default_queue  # the steps' queue: a worker would go on inline
    fake.app.tasks[wf.steps[0].task_name].apply(kwargs={"run_id": run_id}, routing_key=queue)

    assert [s.name for s in fake.list_steps(run_id)] == ["first"]
    assert fake.get_run(run_id).status == "running"
    assert fake.run_until_idle() == 1
    assert fake.get_run(run_id).status == "completed"
    fake.close()
