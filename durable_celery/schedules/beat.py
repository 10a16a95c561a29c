"""``DurableScheduler``: Celery's default beat scheduler, plus the run-time schedules that
``durable.schedule()`` keeps in the database when there is no RedBeat (the embedded default).

Set ``app.conf.beat_scheduler = "durable_celery.beat:DurableScheduler"`` and run
``celery -A app beat``; the scheduler re-reads ``durable_schedules`` every few seconds, so a
schedule created, changed or deleted at run time is seen without restarting beat.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from celery.beat import PersistentScheduler

from ..models import aware
from ..store import schedule_rows
from .fires import FIRE_TASK

log = logging.getLogger("durable_celery")

SCHEDULER_PATH = "durable_celery.beat:DurableScheduler"

#: Seconds beat sleeps at most when nothing is due, unless the app sets ``beat_max_loop_interval``.
LOOP_INTERVAL = 5.0


def default_loop_interval(app: Any) -> None:
    """Have beat look for new run-time schedules every few seconds: left unset, Celery and RedBeat
    sleep up to 300 s while nothing is due, so ``durable.schedule()`` would fire up to 5 minutes
    late. A value the app sets (before or after) is kept; RedBeat's lock timeout, unless set,
    follows as 5 x this interval."""
    if not app.conf.get("beat_max_loop_interval"):  # Celery's own default is 0: "unset"
        app.conf.beat_max_loop_interval = LOOP_INTERVAL


class DurableScheduler(PersistentScheduler):
    """Celery's persistent scheduler that also runs durable run-time schedules from the database."""

    #: Seconds between reads of the run-time schedules.
    refresh_interval = 2.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._runtime: dict[str, str] = {}  # name -> the definition it was built from
        self._refreshed_at = 0.0
        super().__init__(*args, **kwargs)

    def setup_schedule(self) -> None:
        """Load ``beat_schedule`` as Celery does, then the run-time schedules."""
        super().setup_schedule()
        self.refresh()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One beat iteration; re-reads the run-time schedules when they are due for it."""
        if time.monotonic() - self._refreshed_at >= self.refresh_interval:
            self.refresh()
        return float(min(super().tick(*args, **kwargs), self.refresh_interval))

    def refresh(self) -> None:
        """Add, change and drop entries to match the enabled run-time schedules."""
        from . import config_entries, runtime_kwargs

        self._refreshed_at = time.monotonic()
        rt = getattr(self.app, "_durable_runtime", None)
        if rt is None:
            return
        try:
            with rt.db.engine.connect() as conn:
                rows = schedule_rows.fetch_schedules(conn)
        except Exception as exc:  # the database may be restarting: keep what we have
            log.warning("durable beat: could not read run-time schedules: %s", exc)
            return
        configured = config_entries(self.app)
        wanted = {}
        for row in rows:
            if row.enabled and row.name not in configured:
                built = runtime_kwargs(rt, self.app, row)
                if built is not None:
                    wanted[row.name] = (row, *built)
        for name in set(self._runtime) - set(wanted):
            self.schedule.pop(name, None)
            del self._runtime[name]
        for name, (row, sched, kwargs, options) in wanted.items():
            definition = json.dumps([row.schedule, kwargs], sort_keys=True, default=str)
            if self._runtime.get(name) == definition and name in self.schedule:
                continue
            self.schedule[name] = self.Entry(
                name=name,
                task=FIRE_TASK,
                schedule=sched,
                kwargs=kwargs,
                options=options,
                last_run_at=aware(row.last_fire_at or row.created_at),
                app=self.app,
            )
            self._runtime[name] = definition
