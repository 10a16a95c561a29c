"""The load of a chaos scenario: producer threads starting keyed and unkeyed runs, key racers in
other processes (``racer.py``), and a sampler that checks the key table the whole time.

Every start is kept as a ``Start``: what was asked, what it returned or raised, and the tries.
A start that raises ``DatabaseUnavailable`` is tried again, as a caller would, until it goes
through (or ``RETRY_FOR`` seconds pass).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from durable_celery import DatabaseUnavailable, Durable, KeyContended, KeyTaken, SendEvent
from tests.chaos.workflows import new_input

READY_WITHIN = 60.0  # seconds a racer process may take to start on a busy machine
RETRY_FOR = 90.0  # how long a producer keeps trying a start the database refused
POLICIES = ("use_existing", "run_again", "error", "cancel_existing", "send_event")
POLICY_WEIGHTS = (40, 25, 15, 10, 10)


@dataclass
class Start:
    """One call to ``start`` (with its retries) and what came of it."""

    workflow: str
    tag: str
    key: str | None = None
    policy: str | None = None
    t0: float = 0.0
    t1: float = 0.0
    run_id: str | None = None
    outcome: str = "ok"  # ok, key_taken, contended, gave_up, unexpected
    holder: str | None = None  # KeyTaken's holder_id
    errors: list[tuple[float, str, str]] = field(default_factory=list)  # (time, type, message) per try


def start_one(
    client: Durable,
    workflow: str,
    data: dict[str, Any],
    key: str | None,
    policy: str | None,
    abort: threading.Event | None = None,
) -> Start:
    """Start a run as a careful caller does: try again while the database is unavailable
    (until ``abort`` is set)."""
    rec = Start(workflow, data["tag"], key, policy, t0=time.time())
    on_duplicate: Any = SendEvent("nudge") if policy == "send_event" else policy
    while True:
        try:
            rec.run_id = client.start(workflow, data, key=key, on_duplicate=on_duplicate)
        except KeyTaken as exc:
            rec.outcome, rec.holder = "key_taken", exc.holder_id
        except KeyContended:
            rec.outcome = "contended"
        except DatabaseUnavailable as exc:
            rec.errors.append((time.time(), type(exc).__name__, str(exc)))
            if time.time() - rec.t0 < RETRY_FOR and not (abort is not None and abort.is_set()):
                time.sleep(0.3)
                continue
            rec.outcome = "gave_up"
        except Exception as exc:  # noqa: BLE001 - anything else is a finding, kept for the checks
            rec.errors.append((time.time(), type(exc).__name__, str(exc)[:500]))
            rec.outcome = "unexpected"
        rec.t1 = time.time()
        return rec


def pick_start(
    rng: random.Random, keys: int, key_prefix: str, keyed_share: float
) -> tuple[str, str | None, str | None]:
    """A workflow, key and policy for the next start: unkeyed ``chain`` and ``doomed`` runs and
    keyed runs with every ``on_duplicate`` policy."""
    if rng.random() < keyed_share:
        key = f"{key_prefix}:{rng.randrange(keys)}"
        return "keyed", key, rng.choices(POLICIES, POLICY_WEIGHTS)[0]
    return ("doomed" if rng.random() < 0.25 else "chain"), None, None


class Producers:
    """``threads`` threads starting runs, ``rate`` starts a second in all, until ``stop()``;
    ``long_share`` of the steps take 2.5 s (``workflows.step_times``)."""

    def __init__(
        self,
        client: Durable,
        seed: int,
        threads: int = 3,
        rate: float = 2.5,
        keys: int = 8,
        long_share: float = 0.05,
    ) -> None:
        self.client, self.seed, self.rate, self.keys = client, seed, rate, keys
        self.long_share = long_share
        self.starts: list[Start] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(threads)]

    def start(self) -> Producers:
        for thread in self._threads:
            thread.start()
        return self

    def _run(self, n: int) -> None:
        rng = random.Random(self.seed * 100 + n)
        pause = len(self._threads) / self.rate
        while not self._stop.is_set():
            workflow, key, policy = pick_start(rng, self.keys, "item", 0.4)
            rec = start_one(self.client, workflow, new_input(rng, self.long_share), key, policy, self._abort)
            with self._lock:
                self.starts.append(rec)
            self._stop.wait(pause * rng.uniform(0.5, 1.5))

    def stop(self) -> list[Start]:
        self._stop.set()
        for thread in self._threads:
            thread.join(RETRY_FOR + 30)
        return self.starts

    def abort(self) -> None:
        """Stop at once, giving up starts the database refuses (the scenario failed)."""
        self._abort.set()
        self.stop()


class Racers:
    """``processes`` x ``threads`` starts of the same few keys with every ``on_duplicate``
    policy, from other processes (``python -m tests.chaos.racer``), each thread pausing about
    ``pause`` seconds between starts, from ``go()`` until ``stop()`` (``seconds`` at most)."""

    def __init__(
        self,
        env: dict[str, str],
        folder: Path,
        seconds: float = 900.0,
        processes: int = 4,
        threads: int = 8,
        pause: float = 0.25,
    ) -> None:
        self.env, self.folder, self.seconds, self.pause = env, folder, seconds, pause
        self.processes, self.threads = processes, threads
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> Racers:
        """Start the racer processes and wait until each is ready; ``go()`` lets them race."""
        root = Path(__file__).resolve().parents[2]
        for n in range(self.processes):
            cmd = [sys.executable, "-m", "tests.chaos.racer", "--out", str(self._out(n)), "--seed", str(n)]
            cmd += [
                "--threads",
                str(self.threads),
                "--pause",
                str(self.pause),
                "--seconds",
                str(self.seconds),
            ]
            cmd += ["--go", str(self.folder / "go"), "--stop", str(self.folder / "stop")]
            with open(self._log(n), "w") as log:
                proc = subprocess.Popen(cmd, cwd=root, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            self.procs.append(proc)
        deadline = time.monotonic() + READY_WITHIN
        for n, proc in enumerate(self.procs):
            while "ready" not in self._log(n).read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"racer {n} did not start:\n{self._log(n).read_text()[-3000:]}")
                time.sleep(0.05)
        return self

    def go(self) -> None:
        (self.folder / "go").touch()

    def _log(self, n: int) -> Path:
        return self.folder / f"racer-{n}.log"

    def _out(self, n: int) -> Path:
        return self.folder / f"racer-{n}.jsonl"

    def read(self) -> list[Start]:
        """The starts the racers have written so far."""
        starts = []
        for n in range(len(self.procs)):
            if not self._out(n).exists():
                continue
            for line in self._out(n).read_text().splitlines():
                try:
                    fields = json.loads(line)
                except ValueError:  # a line still being written
                    continue
                fields["errors"] = [tuple(error) for error in fields["errors"]]
                starts.append(Start(**fields))
        return starts

    def stop(self) -> list[Start]:
        """Tell the racers to stop, wait for them (a start the database refuses is tried for up
        to ``RETRY_FOR`` s); their starts."""
        (self.folder / "stop").touch()
        for n, proc in enumerate(self.procs):
            code = proc.wait(RETRY_FOR + 60)
            log = self._log(n).read_text(errors="replace")
            assert code == 0, f"racer {n} exited {code}:\n{log[-3000:]}"
        return self.read()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def dump(rec: Start) -> str:
    return json.dumps(asdict(rec))


# One statement, so one snapshot: what it finds was true at one instant.
KEY_INVARIANTS = """
WITH live AS (
    SELECT r.id, r.workflow, r.key, r.status, r.runs_after_id FROM durable_runs r
    WHERE r.key IS NOT NULL AND r.status IN ('pending', 'running', 'waiting', 'compensating')
), holding AS (
    SELECT l.* FROM live l WHERE NOT EXISTS (SELECT 1 FROM durable_keys k WHERE k.waiting_id = l.id)
)
SELECT 'two unfinished holders', workflow, key, array_agg(id::text) FROM holding
    GROUP BY workflow, key HAVING count(*) > 1
UNION ALL
SELECT 'an unfinished run does not hold its key', h.workflow, h.key, ARRAY[h.id::text] FROM holding h
    WHERE NOT EXISTS (
        SELECT 1 FROM durable_keys k WHERE k.holder_id = h.id AND k.workflow = h.workflow AND k.key = h.key
    )
UNION ALL
SELECT 'two runs waiting behind one holder', workflow, key, array_agg(id::text) FROM live
    WHERE status = 'waiting' AND runs_after_id IS NOT NULL GROUP BY workflow, key HAVING count(*) > 1
UNION ALL
SELECT 'a finished holder with a run still waiting behind it', k.workflow, k.key,
       ARRAY[k.holder_id::text, k.waiting_id::text]
    FROM durable_keys k JOIN durable_runs h ON h.id = k.holder_id
    WHERE k.waiting_id IS NOT NULL AND h.status NOT IN ('pending', 'running', 'waiting', 'compensating')
"""


class KeySampler:
    """Checks the key invariants every ``interval`` seconds while the faults happen."""

    def __init__(self, url: str, interval: float = 0.2) -> None:
        self.url, self.interval = url, interval
        self.samples = 0
        self.unreachable = 0  # samples the database did not answer (it was down)
        self.violations: list[tuple[float, str, str, str, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> KeySampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                rows = conn.execute(KEY_INVARIANTS).fetchall()
                self.samples += 1
                self.violations.extend((time.time(), *row) for row in rows)
            except psycopg.OperationalError:
                self.unreachable += 1
                if conn is not None:
                    conn.close()
                conn = None
            self._stop.wait(self.interval)
        if conn is not None:
            conn.close()

    def stop(self) -> KeySampler:
        self._stop.set()
        self._thread.join(30)
        return self
