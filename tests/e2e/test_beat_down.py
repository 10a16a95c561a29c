"""Beat stopped: a real `celery beat` fires a 2 s schedule, then is stopped; once the schedule is
overdue by more than its period plus the margin, `doctor` reports `schedule_late` with its fix,
`status` and `durable schedules` say so, the dashboard's schedules page marks it, and the gauge
`durable_schedules_late` counts it. Beat started again clears it.

Both schedulers durable supports on PostgreSQL + Redis: RedBeat (last fire read from its entry)
and DurableScheduler, Celery's own scheduler (last fire read from `durable_schedules`). A real
worker runs the fires. Fails (never skips) without the servers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from starlette.testclient import TestClient

from durable_celery import Durable
from durable_celery.web import create_app
from tests.conftest import REDIS_URL
from tests.e2e.support import until

ROOT = Path(__file__).resolve().parents[2]
PERIOD = 2.0

APP = textwrap.dedent(
    """
    import os
    from celery import Celery
    from durable_celery import Durable

    app = Celery("beatdownapp", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    app.conf.beat_max_loop_interval = 0.5
    if os.environ["SCHEDULER"] == "redbeat":
        app.conf.redbeat_redis_url = os.environ["BROKER"]
        app.conf.redbeat_key_prefix = os.environ["PREFIX"]
    else:
        app.conf.beat_scheduler = "durable_celery.beat:DurableScheduler"
    durable = Durable(app, os.environ["DB"], poll_interval=0.2)

    tick = durable.workflow("tick")
    tick.step(lambda n=0: n, name="work")
    app.conf.beat_schedule = {"tick": durable.beat_entry("tick", float(os.environ["PERIOD"]), key="t")}
    """
)


class Stack:
    """The worker and beat processes of one test, and a Durable of the same app beside them."""

    def __init__(self, env: dict[str, str], folder: Path, durable: Durable) -> None:
        self.env, self.folder, self.durable = env, folder, durable
        self.procs: dict[str, subprocess.Popen[Any]] = {}

    def start(self, name: str, *args: str) -> None:
        command = [sys.executable, "-m", "celery", "-A", "beatdownapp", *args, "-l", "info"]
        with (self.folder / f"{name}.log").open("a") as log:
            self.procs[name] = subprocess.Popen(
                command, cwd=self.folder, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def stop(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in self.folder.glob("*.log"))

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "celery", "-A", "beatdownapp", "durable", *args]
        return subprocess.run(
            command, cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=60
        )


@pytest.fixture(params=["redbeat", "durable"])
def stack(request: pytest.FixtureRequest, pg_url: str, tmp_path: Path, redis_client: Any) -> Iterator[Stack]:
    scheduler = request.param
    (tmp_path / "beatdownapp.py").write_text(APP)
    tag = uuid.uuid4().hex[:8]
    base = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    env = {
        **base,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
        "BROKER": REDIS_URL,
        "QUEUE": f"beatdown-{tag}",
        "PREFIX": f"beatdown-{tag}:",
        "SCHEDULER": scheduler,
        "PERIOD": str(PERIOD),
        "DB": pg_url,
    }
    app = Celery("beatdownapp", broker=REDIS_URL)
    app.conf.task_default_queue = env["QUEUE"]
    app.conf.beat_max_loop_interval = 0.5
    if scheduler == "redbeat":
        app.conf.update(redbeat_redis_url=REDIS_URL, redbeat_key_prefix=env["PREFIX"])
    else:
        app.conf.beat_scheduler = "durable_celery.beat:DurableScheduler"
    durable = Durable(app, pg_url, upkeep=False)
    tick = durable.workflow("tick")
    tick.step(lambda n=0: n, name="work")
    app.conf.beat_schedule = {"tick": durable.beat_entry("tick", PERIOD, key="t")}
    stack = Stack(env, tmp_path, durable)
    try:
        yield stack
    finally:
        for name in list(stack.procs):
            if stack.procs[name].poll() is None:
                stack.stop(name)
        durable.db.dispose()
        for key in redis_client.scan_iter(match=f"{env['PREFIX']}*"):
            redis_client.delete(key)


def late_findings(durable: Durable) -> list[Any]:
    return [f for f in durable.doctor() if f.kind == "schedule_late"]


@pytest.mark.timeout(180)
def test_a_schedule_overdue_by_more_than_its_period_is_late_while_beat_is_down(stack: Stack) -> None:
    durable = stack.durable
    beat_args = ["beat", "-s", str(stack.folder / "beat-schedule")]
    stack.start("worker", "worker", "-P", "threads", "-c", "2", "-n", f"w-{uuid.uuid4().hex[:6]}@%h")
    stack.start("beat", *beat_args)

    def fired_twice() -> bool:
        return len(durable.list_runs(workflow="tick", status="completed")) >= 2

    until(fired_twice, 60, "two fires of the schedule", stack.logs)
    assert late_findings(durable) == [] and not durable.get_schedule("tick:t").late
    assert durable.metrics.value("durable_schedules_late") == 0

    stack.stop("beat")
    stopped_at = time.monotonic()
    (finding,) = until(lambda: late_findings(durable), 60, "a schedule_late finding", stack.logs)
    shown_after = time.monotonic() - stopped_at
    schedule = durable.get_schedule("tick:t")
    assert schedule.late and schedule.overdue_seconds > PERIOD + 10
    assert finding.details["schedule"] == "tick:t" and finding.workflow == "tick"
    scheduler = "redbeat.RedBeatScheduler" if stack.env["SCHEDULER"] == "redbeat" else "DurableScheduler"
    assert scheduler in finding.message and "running?" in finding.message
    assert durable.metrics.value("durable_schedules_late") == 1

    doctor = stack.cli("doctor")
    assert doctor.returncode == 1 and "schedule_late" in doctor.stdout, doctor.stdout + doctor.stderr
    status = stack.cli("status")
    assert "late schedule: tick:t (every 2s) should have fired" in status.stdout, status.stdout
    listed = stack.cli("schedules")
    (line,) = [line for line in listed.stdout.splitlines() if line.startswith("tick:t")]
    assert " late " in line and "in 0s" not in line
    page = TestClient(create_app(durable)).get("/schedules").text
    assert 'id="late"' in page and "late " in page and scheduler in page

    stack.start("beat", *beat_args)  # beat is back: its first fire clears it
    until(lambda: not late_findings(durable), 60, "the finding cleared", stack.logs)
    assert durable.metrics.value("durable_schedules_late") == 0
    print(f"\n{stack.env['SCHEDULER']}: schedule_late shown {shown_after:.1f}s after beat stopped")
