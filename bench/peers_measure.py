"""CPU of a system under test for ``bench.peers``, read from ``/proc``; and the machine's facts.

A system's processes are its worker processes with their descendants (Celery's pool
processes), its producer process, and for the Celery-based ones the bench's ``redis-server``
(their broker, where DBOS and procrastinate use PostgreSQL). Its PostgreSQL backends are found
by their client ports: every TCP socket those processes hold (``/proc/<pid>/fd`` and
``/proc/net/tcp``) against ``pg_stat_activity.client_port``, so every engine and pool of every
library counts, whatever ``application_name`` it sets, and nothing of the bench's own
connections or the other systems' does. A sampler thread reads them every ``SAMPLE`` seconds
while a measurement runs (a backend or a process that appears is counted from zero; one that
ends counts until its last sample), user + system time of every thread.
"""

from __future__ import annotations

import os
import platform
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")
SAMPLE = 0.25
PARTS = ("workers", "producer", "postgres", "redis")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def parents() -> dict[int, int]:
    """Every process's parent pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    found[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return found


def with_descendants(roots: Iterable[int], tree: dict[int, int]) -> set[int]:
    """These processes and all their descendants (``tree``: every process's parent)."""
    found = set(roots)
    grew = True
    while grew:
        more = {pid for pid, ppid in tree.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return found


def local_ports(pids: Iterable[int]) -> set[int]:
    """Local ports of the TCP sockets these processes hold open."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    cols = line.split()
                    if cols[9] in inodes:
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return ports


@dataclass
class Target:
    """What to measure: worker root pids, the producer's pid, the broker's pid (or None)."""

    workers: list[int]
    producer: int
    redis: int | None = None


@dataclass
class Meter:
    """Samples a target's CPU by part while a measurement runs (``with meter.watch(target)``)."""

    backends_of: Any  # callable(ports) -> list of backend pids
    first: dict[tuple[str, int], float] = field(default_factory=dict)
    last: dict[tuple[str, int], float] = field(default_factory=dict)

    def _pids(self, target: Target) -> dict[str, set[int]]:
        """The target's processes now, by part."""
        tree = parents()
        workers = with_descendants(target.workers, tree)
        producer = with_descendants([target.producer], tree)
        backends = set(self.backends_of(local_ports(workers | producer)))
        return {
            "workers": workers,
            "producer": producer,
            "postgres": backends,
            "redis": {target.redis} if target.redis else set(),
        }

    def _sample(self, target: Target, start: bool = False) -> None:
        """Read every process of the target once."""
        for part, pids in self._pids(target).items():
            for pid in pids:
                value = cpu_seconds(pid)
                if value is None:
                    continue
                if start:
                    self.first[(part, pid)] = value
                self.last[(part, pid)] = value

    def measure(self, target: Target, action: Any) -> tuple[Any, dict[str, float]]:
        """Run ``action()`` while sampling; returns its result and CPU seconds by part."""
        self.first, self.last = {}, {}
        self._sample(target, start=True)
        stop = threading.Event()

        def sampler() -> None:
            while not stop.wait(SAMPLE):
                self._sample(target)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        try:
            result = action()
        finally:
            stop.set()
            thread.join()
        self._sample(target)
        used = dict.fromkeys(PARTS, 0.0)
        for (part, pid), value in self.last.items():
            used[part] += value - self.first.get((part, pid), 0.0)
        return result, used


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``values``, nearest rank."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


def median(values: list[float]) -> float:
    """The median (the mean of the middle two for an even count)."""
    ordered = sorted(v for v in values if v == v)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def load_average() -> str:
    """The 1, 5 and 15 minute load averages."""
    with open("/proc/loadavg") as avg:
        return " ".join(avg.read().split()[:3])


def cpu_model() -> str:
    """The processor's model name."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions(names: Iterable[str]) -> dict[str, str]:
    """Installed versions of these distributions (``-`` when absent)."""
    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "-"
    return found
