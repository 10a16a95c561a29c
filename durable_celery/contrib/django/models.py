"""Durable's tables as read-only, unmanaged Django models, for the admin and for queries.

Durable writes its rows (``start``, ``cancel``, ``retry``, ``rerun``, ``release_key``, ...);
these models only read them. Every write through them (``save``, ``delete``, ``create``,
QuerySet ``update``, ``delete``, ``bulk_create``, ...) raises InvalidArgument before any SQL.
Relations use ``db_constraint=False``: the tables' own rules (schema.py) hold, not Django's.

The models read the alias of ``CELERY_DURABLE_READ_DATABASE_ALIAS`` (a streaming replica) when
that setting is given, else that of ``CELERY_DURABLE_DATABASE_ALIAS``, and the alias Django's
routers pick otherwise.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NoReturn

from django.db import models
from django.utils import timezone

from ...errors import InvalidArgument


def _refuse(what: str, model: Any) -> NoReturn:
    """Raise InvalidArgument: a write through a read-only model."""
    name = getattr(model, "__name__", type(model).__name__)
    raise InvalidArgument(
        f"{name}.{what}(): durable's tables are read-only in Django; writes go through the durable "
        "API (start, cancel, retry, rerun, release_key, ...), e.g. durable_for(alias).cancel(run_id)"
    )


class ReadOnlyQuerySet(models.QuerySet):  # type: ignore[type-arg]
    """A QuerySet that reads; every write method raises InvalidArgument."""

    def create(self, **kwargs: Any) -> NoReturn:
        """Refused: durable writes its rows."""
        _refuse("create", self.model)

    def get_or_create(self, defaults: Any = None, **kwargs: Any) -> NoReturn:
        """Refused: durable writes its rows."""
        _refuse("get_or_create", self.model)

    def update_or_create(self, defaults: Any = None, create_defaults: Any = None, **kwargs: Any) -> NoReturn:
        """Refused: durable writes its rows."""
        _refuse("update_or_create", self.model)

    def bulk_create(self, objs: Any, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: durable writes its rows."""
        _refuse("bulk_create", self.model)

    def bulk_update(self, objs: Any, fields: Any, batch_size: Any = None) -> NoReturn:
        """Refused: durable writes its rows."""
        _refuse("bulk_update", self.model)

    def update(self, **kwargs: Any) -> NoReturn:
        """Refused: durable writes its rows."""
        _refuse("update", self.model)

    def delete(self) -> NoReturn:
        """Refused: durable deletes its rows (``prune``)."""
        _refuse("delete", self.model)

    delete.queryset_only = True  # type: ignore[attr-defined]  # as Django's: no Manager.delete

    def _update(self, values: Any) -> NoReturn:
        _refuse("update", self.model)

    def _raw_delete(self, using: Any) -> NoReturn:
        _refuse("delete", self.model)


class ReadOnlyManager(models.Manager.from_queryset(ReadOnlyQuerySet)):  # type: ignore[misc]
    """The models' manager: reads on durable's alias (``CELERY_DURABLE_DATABASE_ALIAS``, when
    given), refuses writes."""

    def get_queryset(self) -> ReadOnlyQuerySet:
        """Rows on durable's read replica or alias when a setting names one, else where the
        routers say."""
        from django.conf import settings

        queryset: ReadOnlyQuerySet = super().get_queryset()
        alias = getattr(settings, "CELERY_DURABLE_READ_DATABASE_ALIAS", None) or getattr(
            settings, "CELERY_DURABLE_DATABASE_ALIAS", None
        )
        return queryset.using(alias) if alias and self._db is None else queryset


class ReadOnlyModel(models.Model):
    """A row durable keeps: read here, written only by durable."""

    objects = ReadOnlyManager()

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: durable writes its rows."""
        _refuse("save", type(self))

    def save_base(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: durable writes its rows."""
        _refuse("save", type(self))

    def delete(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: durable deletes its rows (``prune``)."""
        _refuse("delete", type(self))


def seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    """Seconds from ``start`` to ``end`` (to now when ``end`` is None); None without a start."""
    if start is None:
        return None
    return max(((end or timezone.now()) - start).total_seconds(), 0.0)


def _run(related_name: str, **options: Any) -> Any:
    """A reference to a run, without a database constraint (the tables keep their own rules)."""
    return models.ForeignKey(
        "DurableRun",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name=related_name,
        **options,
    )


class DurableRun(ReadOnlyModel):
    """One run of a workflow (``durable_runs``)."""

    id = models.CharField(primary_key=True, max_length=36)
    workflow = models.CharField(max_length=200)
    status = models.CharField(max_length=24)
    input = models.JSONField()
    context = models.JSONField()
    output = models.JSONField(null=True)
    error = models.JSONField(null=True)
    key = models.CharField(max_length=255, null=True)
    runs_after = _run("+", null=True)
    parent = _run("children", null=True)
    parent_ref = models.CharField(max_length=200, null=True)
    queue = models.CharField(max_length=200, null=True)
    trace_parent = models.CharField(max_length=64, null=True)
    step_index = models.IntegerField()
    step_name = models.CharField(max_length=200, null=True)
    attempt = models.IntegerField()
    attempt_base = models.IntegerField()
    fence = models.IntegerField()
    locked_by = models.CharField(max_length=255, null=True)
    heartbeat_at = models.DateTimeField(null=True)
    due_at = models.DateTimeField(null=True)
    published = models.BooleanField()
    resends = models.IntegerField()
    resend_at = models.DateTimeField(null=True)
    not_after = models.DateTimeField(null=True)
    deadline_at = models.DateTimeField(null=True)
    wait_name = models.CharField(max_length=200, null=True)
    wait_until = models.DateTimeField(null=True)
    losses = models.IntegerField()
    slot_key = models.CharField(max_length=255, null=True)
    throttle_key = models.CharField(max_length=255, null=True)
    rate_key = models.CharField(max_length=255, null=True)
    flow_wait = models.CharField(max_length=16, null=True)
    line_at = models.DateTimeField("in line at")
    fair_key = models.CharField(max_length=255, null=True)
    priority = models.IntegerField(null=True)
    batch_key = models.CharField(max_length=255, null=True)
    progress = models.JSONField(null=True)
    tags = models.JSONField(null=True)
    forked_from = models.CharField(max_length=36, null=True)
    created_at = models.DateTimeField("created")
    started_at = models.DateTimeField("started", null=True)
    finished_at = models.DateTimeField("finished", null=True)

    class Meta:
        managed = False
        db_table = "durable_runs"
        verbose_name = "run"

    def __str__(self) -> str:
        return f"{self.workflow} {self.id}"

    @property
    def holds_key(self) -> bool:
        """True while the run holds its key (a row of ``durable_keys`` names it holder)."""
        return DurableKey.objects.using(self._state.db).filter(holder_id=self.pk).exists()

    @property
    def queued_seconds(self) -> float | None:
        """Seconds from creation to the first step's start (to now, while it has not started)."""
        return seconds_between(self.created_at, self.started_at)

    @property
    def running_seconds(self) -> float | None:
        """Seconds from the start to the end (to now, while unfinished); None before the start."""
        return seconds_between(self.started_at, self.finished_at)

    @property
    def total_seconds(self) -> float | None:
        """Seconds from creation to the end (to now, while unfinished)."""
        return seconds_between(self.created_at, self.finished_at)


class DurableStep(ReadOnlyModel):
    """One recorded attempt of one step, or of its compensation (``durable_steps``)."""

    id = models.BigAutoField(primary_key=True)
    run = _run("steps")
    step_index = models.IntegerField()
    phase = models.CharField(max_length=16)
    name = models.CharField(max_length=200)
    attempt = models.IntegerField()
    status = models.CharField(max_length=24)
    input = models.JSONField(null=True)
    output = models.JSONField(null=True)
    error = models.JSONField(null=True)
    context = models.JSONField(null=True)
    worker = models.CharField(max_length=255, null=True)
    logs = models.JSONField(null=True)
    started_at = models.DateTimeField("started")
    finished_at = models.DateTimeField("finished")

    class Meta:
        managed = False
        db_table = "durable_steps"
        verbose_name = "step"

    def __str__(self) -> str:
        return f"{self.name} #{self.attempt} of {self.run_id}"  # type: ignore[attr-defined]

    @property
    def running_seconds(self) -> float:
        """Seconds the attempt ran, from its start to its end."""
        return seconds_between(self.started_at, self.finished_at) or 0.0


class DurableKey(ReadOnlyModel):
    """A held key (``durable_keys``): its primary key is (workflow, key); here it is the holder,
    which is unique too (one key per run)."""

    holder = models.OneToOneField(
        DurableRun,
        primary_key=True,
        db_column="holder_id",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="held_key",
    )
    workflow = models.CharField(max_length=200)
    key = models.CharField(max_length=255)
    waiting = _run("+", null=True)
    taken_at = models.DateTimeField("taken")

    class Meta:
        managed = False
        db_table = "durable_keys"
        verbose_name = "key"

    def __str__(self) -> str:
        return f"{self.workflow} {self.key}"


class DurableActivity(ReadOnlyModel):
    """One thing that happened (key decisions and more), kept for a week (``durable_activity``);
    its run may have been pruned since."""

    id = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=40)
    run = _run("activity", null=True)
    workflow = models.CharField(max_length=200, null=True)
    key = models.CharField(max_length=255, null=True)
    details = models.JSONField()
    at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "durable_activity"
        verbose_name = "activity entry"
        verbose_name_plural = "activity"

    def __str__(self) -> str:
        return f"{self.kind} {self.run_id or ''}".strip()  # type: ignore[attr-defined]


class DurableSchedule(ReadOnlyModel):
    """The shared state of a keyed schedule (``durable_schedules``); its definition lives in
    the beat scheduler."""

    name = models.CharField(primary_key=True, max_length=200)
    workflow = models.CharField(max_length=200)
    key = models.CharField(max_length=255, null=True)
    schedule = models.CharField(max_length=200)
    input = models.JSONField(null=True)
    enabled = models.BooleanField()
    failures = models.IntegerField()
    last_outcome = models.CharField(max_length=40, null=True)
    last_run = _run("+", null=True)
    last_fire_at = models.DateTimeField(null=True)
    disabled_at = models.DateTimeField(null=True)
    created_at = models.DateTimeField("created")
    updated_at = models.DateTimeField("updated")

    class Meta:
        managed = False
        db_table = "durable_schedules"
        verbose_name = "schedule"

    def __str__(self) -> str:
        return self.name
