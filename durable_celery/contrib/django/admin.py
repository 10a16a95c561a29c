"""Durable in the Django admin: runs, their steps and key activity, held keys, schedules.

Everything is read-only: no add, change or delete page writes a row. The actions (cancel,
retry, rerun, release keys) call durable's API through ``durable_for(alias)`` and report each
run's outcome as a message; they need the model's change permission. With the setting
``CELERY_DURABLE_DASHBOARD_URL``, a run's page links to it on durable's dashboard.
Lists fit a 1366 px screen (long ids and keys cut short, whole in the tooltip); durations read
"1.2 s", "3 min 4 s"; errors show as text with their traceback; titles say "View run".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.utils import flatten_fieldsets, quote
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import mark_safe

from ...errors import DurableError
from ...observe.activity import key_blocks
from .admin_bulk import all_matching
from .admin_filters import (
    CappedPaginator,
    KeyFilter,
    KindFilter,
    PhaseFilter,
    RunSearch,
    RunStatusFilter,
    StepStatusFilter,
    TagFilter,
    WorkflowFilter,
)
from .durable import DEFAULT_ALIAS, DjangoDurable, durable_for
from .models import DurableActivity, DurableKey, DurableRun, DurableSchedule, DurableStep

# At most this many messages per action; the rest are counted in one more.
MESSAGES_SHOWN = 20

# What an action does to one run: a message level and text, or a DurableError raised.
Act = Callable[[DjangoDurable, str], tuple[int, str]]

# Lists show this many characters of an id and of a key, "…" included.
ID_SHOWN = 7
KEY_SHOWN = 32

# A <pre> block that wraps long lines rather than widen the page; text kept on one line.
PRE = '<pre style="white-space: pre-wrap; overflow-wrap: anywhere; margin: 0">{}</pre>'
NOWRAP = '<span style="white-space: nowrap">{}</span>'


def human_duration(seconds: float | None) -> str:
    """Seconds for people: ``350 ms``, ``1.2 s``, ``42 s``, ``3 min 4 s``, ``2 h 5 min``, ``3 d 4 h``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{max(seconds, 0.0) * 1000:.0f} ms"
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    for unit, size, smaller, part in (("d", 86400, "h", 3600), ("h", 3600, "min", 60), ("min", 60, "s", 1)):
        if whole >= size:
            count, rest = divmod(whole, size)
            return f"{count} {unit} {rest // part} {smaller}" if rest // part else f"{count} {unit}"
    return f"{whole} s"


def _when(at: datetime | None) -> Any:
    """A moment in the current time zone, to the second, its date and time each kept whole."""
    if at is None:
        return "-"
    date, time = timezone.localtime(at).strftime("%Y-%m-%d %H:%M:%S").split()
    return format_html(NOWRAP + " " + NOWRAP, date, time)


def _duration(seconds: float | None) -> Any:
    """A human duration on one line."""
    return format_html(NOWRAP, human_duration(seconds))


def _json(value: Any) -> Any:
    """A JSON value, indented, in a <pre> block ("-" for none)."""
    if value is None:
        return "-"
    return format_html(PRE, json.dumps(value, indent=2, ensure_ascii=False, default=str))


def _short_id(run_id: str) -> Any:
    """An id's end (a time-ordered id differs there), the whole id in the tooltip."""
    shown = run_id if len(run_id) <= ID_SHOWN else "…" + run_id[1 - ID_SHOWN :]
    return format_html('<span title="{}" style="white-space: nowrap">{}</span>', run_id, shown)


def _wrapping(text: str, after: str, shown: int = KEY_SHOWN) -> Any:
    """``text`` cut short (the whole of it in the tooltip) that wraps only after an ``after``."""
    cut = len(text) > shown
    shown_text = text[: shown - 1] if cut else text
    parts = [part for part in re.split(f"(?<={re.escape(after)})", shown_text) if part]
    if cut:  # the "…" stays on the line of the part it ends
        parts[-1] += "…"
    joined = format_html_join(mark_safe("<wbr>"), NOWRAP, ((part,) for part in parts))
    return format_html('<span title="{}">{}</span>', text, joined)


def _name(name: str) -> Any:
    """A name (workflow, step, status) on one line; a long one wraps after an underscore."""
    if len(name) <= 16:
        return format_html(NOWRAP, name)
    return _wrapping(name, "_", 48)


def _run_link(run_id: str | None, site: str = "admin", *, short: bool = True) -> Any:
    """A link to a run's admin page, by id only (the run may have been pruned since)."""
    if not run_id:
        return "-"
    url = reverse(f"{site}:durable_celery_durablerun_change", args=[quote(run_id)])
    return format_html('<a href="{}">{}</a>', url, _short_id(run_id) if short else run_id)


def _error(value: Any) -> str:
    """An error as ``type: message`` (its traceback is on the step's own page)."""
    if not value:
        return "-"
    if isinstance(value, dict):
        return f"{value.get('type') or 'Error'}: {value.get('message') or ''}".rstrip(": ")
    return str(value)


def _error_text(value: Any) -> Any:
    """An error as text in a <pre> block: ``type: message`` on top, its other details, then its
    traceback with its own line breaks ("-" for none)."""
    if not value:
        return "-"
    if not isinstance(value, dict):
        return format_html(PRE, str(value))
    shown = ("type", "message", "traceback")  # in their own places
    lines = [_error(value), *(f"{name}: {detail}" for name, detail in value.items() if name not in shown)]
    if value.get("traceback"):
        lines += ["", str(value["traceback"]).rstrip()]
    return format_html(PRE, "\n".join(lines))


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """An admin that shows durable's rows and writes none: no add, no delete, every field
    read-only. The change permission is kept at model level, where it allows the actions.
    Its lists count at most 10,001 rows (CappedPaginator)."""

    paginator = CappedPaginator
    show_full_result_count = False  # no second count of the whole table

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Never: durable creates its rows."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Never: durable deletes its rows (``prune``)."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """The user's permission for actions (no object); a row's page is view-only."""
        if obj is not None:
            return False
        return bool(super().has_change_permission(request))

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        """Every field, and every shown method (those the page's fields name too)."""
        shown = flatten_fieldsets(self.fieldsets) if self.fieldsets else list(self.fields or ())
        fields = [f.name for f in self.model._meta.fields if f.name not in (self.exclude or ())]
        return list(dict.fromkeys([*fields, *super().get_readonly_fields(request, obj), *shown]))

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        """The list, titled "View runs" (Django's "Select run to change" misleads here)."""
        title = f"View {self.model._meta.verbose_name_plural}"
        return super().changelist_view(request, {"title": title, **(extra_context or {})})

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> Any:
        """A row's page, titled "View run": nothing on it can be changed."""
        title = f"View {self.model._meta.verbose_name}"
        return super().change_view(request, object_id, form_url, {"title": title, **(extra_context or {})})

    def _act(self, request: HttpRequest, run_ids: Iterable[str], db: str, act: Act) -> None:
        """Call ``act`` on each run with the alias's Durable, reporting each outcome."""
        try:
            durable = durable_for(db)
        except DurableError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        hidden = 0
        for shown, run_id in enumerate(run_ids):
            try:
                level, text = act(durable, run_id)
            except DurableError as exc:
                level, text = messages.ERROR, f"Run {run_id}: {type(exc).__name__}: {exc}"
            if shown < MESSAGES_SHOWN:
                self.message_user(request, text, level)
            else:
                hidden += 1
        if hidden:
            self.message_user(request, f"{hidden} more results not shown.", messages.INFO)

    def _release(self, request: HttpRequest, run_ids: Iterable[str], db: str) -> None:
        """Free the keys the runs hold, recording the admin user as who released them; each
        message names the key and its workflow."""
        by = f"django admin: {request.user.get_username()}"

        def release(durable: DjangoDurable, run_id: str) -> tuple[int, str]:
            run = durable.get_run(run_id)
            key = f"key {run.key!r} of workflow {run.workflow}"
            try:
                durable.release_key(run_id, by=by)
            except DurableError as exc:
                if run.key is None:
                    raise
                return messages.ERROR, f"Run {run_id}: {key} not released: {type(exc).__name__}: {exc}"
            return messages.SUCCESS, f"Run {run_id}: released {key}."

        self._act(request, run_ids, db, release)


def _column(
    description: str, attribute: str, show: Callable[[Any], Any], ordering: str | None = None
) -> Callable[[Any, Any], Any]:
    """A list column or page field showing a row's ``attribute`` for people, through ``show``."""

    @admin.display(description=description, ordering=ordering)
    def column(model_admin: Any, row: Any) -> Any:
        return show(getattr(row, attribute))

    column.__doc__ = f"The row's {attribute}, shown by {show.__name__}."
    return column


def _ids(queryset: QuerySet[Any]) -> Iterable[str]:
    """The primary keys of the selected rows, read as the action goes."""
    return queryset.order_by().values_list("pk", flat=True).iterator()


class ReadOnlyInline(admin.TabularInline):  # type: ignore[type-arg]
    """Rows of a run shown on its page: history, never added, changed or deleted there."""

    extra = 0
    max_num = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Never: durable records them."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Never: they are history."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Never: durable prunes them."""
        return False


class StepInline(ReadOnlyInline):
    """A run's recorded step attempts, each with how long it ran."""

    model = DurableStep
    fields = (
        "step_index",
        "phase",
        "name",
        "attempt",
        "status",
        "worker",
        "started",
        "running",
        "short_error",
    )
    readonly_fields = fields
    ordering = ("step_index", "phase", "attempt", "id")
    show_change_link = True
    started = _column("started", "started_at", _when)
    running = _column("running", "running_seconds", _duration)

    @admin.display(description="error")
    def short_error(self, step: DurableStep) -> str:
        """The attempt's error as ``type: message`` (its traceback on the attempt's page)."""
        return _error(step.error)


class ActivityInline(ReadOnlyInline):
    """What happened to a run's key and more (``durable.activity(run_id=...)``), newest first."""

    model = DurableActivity
    fields = ("when", "kind", "key", "details_json")
    readonly_fields = fields
    ordering = ("-id",)
    verbose_name_plural = "key activity"
    when = _column("at", "at", _when)
    details_json = _column("details", "details", _json)


@admin.register(DurableRun)
class DurableRunAdmin(RunSearch, ReadOnlyAdmin):
    """Runs: filter by workflow, status and key, search by key or id, act on the selected; each
    with how long it queued, ran and took in all."""

    list_display = (
        "short_id",
        "workflow_name",
        "key_link",
        "status_name",
        "step",
        "queued",
        "running",
        "total",
        "created",
    )
    list_filter = (
        WorkflowFilter,
        RunStatusFilter,
        KeyFilter,
        TagFilter,
        ("created_at", admin.DateFieldListFilter),
    )
    search_fields = ("id__exact", "key__exact")  # indexes; a LIKE '%...%' reads every run
    ordering = ("-id",)  # time-ordered ids: the primary key's order, not a sort of every run
    show_full_result_count = False
    inlines = (StepInline, ActivityInline)
    actions = ("cancel_runs", "retry_runs", "rerun_runs", "release_keys")
    fieldsets = (
        (None, {"fields": ("id", "workflow", "status", "key", "holds_key", "tags_json", "error_text")}),
        ("Data", {"fields": ("input_json", "context_json", "output_json", "progress_json")}),
        ("Progress", {"fields": ("step_index", "step_name", "attempt", "queue", "wait_name", "wait_until")}),
        ("Times", {"fields": ("created", "started", "finished", "queued", "running", "total", "deadline")}),
        ("Relations", {"fields": ("parent", "parent_ref", "runs_after", "forked_from_link")}),
        (
            "Internals",
            {
                "classes": ("collapse",),
                "fields": (
                    "attempt_base",
                    "fence",
                    "locked_by",
                    "heartbeat_at",
                    "due_at",
                    "published",
                    "resends",
                    "resend_at",
                    "not_after",
                    "losses",
                    "trace_parent",
                ),
            },
        ),
    )
    readonly_fields = ("dashboard",)  # added by get_fieldsets when configured
    workflow_name = _column("workflow", "workflow", _name, "workflow")
    status_name = _column("status", "status", _name, "status")
    queued = _column("queued", "queued_seconds", _duration)
    running = _column("running", "running_seconds", _duration)
    total = _column("total", "total_seconds", _duration)
    created = _column("created", "created_at", _when)
    started = _column("started", "started_at", _when)
    finished = _column("finished", "finished_at", _when)
    deadline = _column("deadline", "deadline_at", _when)
    error_text = _column("error", "error", _error_text)
    input_json = _column("input", "input", _json)
    context_json = _column("context", "context", _json)
    output_json = _column("output", "output", _json)
    progress_json = _column("progress", "progress", _json)
    tags_json = _column("tags", "tags", _json)
    forked_from_link = _column("forked from", "forked_from", _run_link)

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        """The run's fields; its dashboard link first when ``CELERY_DURABLE_DASHBOARD_URL`` is set."""
        if not _dashboard_url():
            return self.fieldsets
        (name, first), *rest = self.fieldsets
        return ((name, {"fields": (*first["fields"], "dashboard")}), *rest)

    # Sorted by creation (run ids grow with time), so "created" needs no sort arrows of its own.
    @admin.display(description="id", ordering="id")
    def short_id(self, run: DurableRun) -> Any:
        """The run id's end (the whole id in the tooltip); it links to the run's page."""
        return _short_id(run.id)

    @admin.display(description="key", ordering="key")
    def key_link(self, run: DurableRun) -> Any:
        """The run's key, cut short, linking to the runs with that key."""
        if run.key is None:
            return "-"
        return format_html('<a href="?{}">{}</a>', urlencode({"key": run.key}), _wrapping(run.key, ":"))

    @admin.display(description="step", ordering="step_index")
    def step(self, run: DurableRun) -> Any:
        """The step the run is at (or ended at), and its attempt from the second on."""
        step = _name(run.step_name or f"#{run.step_index}")
        return format_html("{}, attempt {}", step, run.attempt) if run.attempt > 1 else step

    @admin.display(description="holds its key", boolean=True)
    def holds_key(self, run: DurableRun) -> bool:
        """Whether the run holds its key now."""
        return run.holds_key

    @admin.display(description="dashboard")
    def dashboard(self, run: DurableRun) -> Any:
        """A link to the run on durable's dashboard."""
        url = f"{_dashboard_url().rstrip('/')}/runs/{quote(run.pk)}"
        return format_html('<a href="{}">{}</a>', url, url)

    @admin.action(description="Cancel selected runs", permissions=["change"])
    @all_matching("cancel")
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Cancel each selected unfinished run."""

        def cancel(durable: DjangoDurable, run_id: str) -> tuple[int, str]:
            if durable.cancel(run_id):
                return messages.SUCCESS, f"Run {run_id}: cancelled."
            return messages.WARNING, f"Run {run_id}: had finished already, not cancelled."

        self._act(request, _ids(queryset), queryset.db, cancel)

    @admin.action(description="Retry selected failed runs", permissions=["change"])
    @all_matching("retry")
    def retry_runs(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Resume each selected failed run from its failed step."""

        def retry(durable: DjangoDurable, run_id: str) -> tuple[int, str]:
            durable.retry(run_id)
            return messages.SUCCESS, f"Run {run_id}: retried from its failed step."

        self._act(request, _ids(queryset), queryset.db, retry)

    @admin.action(description="Rerun selected finished runs", permissions=["change"])
    @all_matching("rerun")
    def rerun_runs(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Start a fresh copy of each selected finished run (same input and key)."""
        site = self.admin_site.name

        def rerun(durable: DjangoDurable, run_id: str) -> tuple[int, str]:
            new_id = durable.rerun(run_id)
            return messages.SUCCESS, format_html(
                "Run {}: rerun as {}.", run_id, _run_link(new_id, site, short=False)
            )

        self._act(request, _ids(queryset), queryset.db, rerun)

    @admin.action(description="Release the keys of selected finished runs", permissions=["change"])
    def release_keys(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Free the key each selected finished run holds."""
        self._release(request, _ids(queryset), queryset.db)


def _dashboard_url() -> str:
    """``CELERY_DURABLE_DASHBOARD_URL``, or "" when not set."""
    return str(getattr(settings, "CELERY_DURABLE_DASHBOARD_URL", "") or "")


def blocks_new_start(key: DurableKey) -> str:
    """Whether a new start of the key's workflow is answered by its holder: "yes", "no" (it takes
    the key), or "unknown" when this process does not define the workflow (nor its ``reuse``)."""
    try:
        workflows = durable_for(key._state.db or DEFAULT_ALIAS).workflows
    except DurableError:
        return "unknown"
    if key.workflow not in workflows:
        return "unknown"
    return "yes" if key_blocks(workflows, key.workflow, key.holder.status) else "no"


@admin.register(DurableKey)
class DurableKeyAdmin(ReadOnlyAdmin):
    """Held keys with their holder (and the run waiting behind it), whether each blocks a new
    start; release them."""

    list_display = (
        "short_key",
        "workflow_name",
        "holder_link",
        "holder_status",
        "blocks",
        "waiting_link",
        "taken",
    )
    list_filter = (WorkflowFilter,)
    search_fields = ("key__exact", "holder__id__exact")
    list_select_related = ("holder",)
    ordering = ("-taken_at",)
    actions = ("release_keys",)

    @admin.display(description="key", ordering="key")
    def short_key(self, key: DurableKey) -> Any:
        """The key, cut short (the whole key in the tooltip); it links to the key's page."""
        return _wrapping(key.key, ":")

    @admin.display(description="blocks a new start")
    def blocks(self, key: DurableKey) -> str:
        """Whether a new start with this key is answered by the holder (the workflow's ``reuse``)."""
        return blocks_new_start(key)

    workflow_name = _column("workflow", "workflow", _name, "workflow")
    taken = _column("taken", "taken_at", _when, "taken_at")

    @admin.display(description="holder")
    def holder_link(self, key: DurableKey) -> Any:
        """The run holding the key."""
        return _run_link(key.holder_id, self.admin_site.name)  # type: ignore[attr-defined]

    @admin.display(description="holder status", ordering="holder__status")
    def holder_status(self, key: DurableKey) -> str:
        """The holder's status."""
        return key.holder.status

    @admin.display(description="waiting")
    def waiting_link(self, key: DurableKey) -> Any:
        """The run waiting behind the holder (run_again), if any."""
        return _run_link(key.waiting_id, self.admin_site.name)  # type: ignore[attr-defined]

    @admin.action(description="Release selected keys (finished holders)", permissions=["change"])
    def release_keys(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Free each selected key whose holder has finished."""
        self._release(request, _ids(queryset), queryset.db)


@admin.register(DurableStep)
class DurableStepAdmin(ReadOnlyAdmin):
    """Every recorded step attempt, with how long it ran and its error's traceback."""

    list_display = (
        "id",
        "run_link",
        "step_index",
        "name",
        "phase",
        "attempt",
        "status",
        "running",
        "finished",
    )
    list_filter = (StepStatusFilter, PhaseFilter)
    search_fields = ("=run__id", "name")
    ordering = ("-id",)
    show_full_result_count = False
    exclude = ("id", "run", "input", "output", "error", "logs", "started_at", "finished_at")  # shown below
    readonly_fields = (
        "run_link",
        "error_text",
        "input_json",
        "output_json",
        "logs_json",
        "started",
        "finished",
    )
    running = _column("running", "running_seconds", _duration)
    started = _column("started", "started_at", _when)
    finished = _column("finished", "finished_at", _when, "finished_at")
    error_text = _column("error", "error", _error_text)
    input_json = _column("input", "input", _json)
    output_json = _column("output", "output", _json)
    logs_json = _column("logs", "logs", _json)

    @admin.display(description="run")
    def run_link(self, step: DurableStep) -> Any:
        """The attempt's run."""
        return _run_link(step.run_id, self.admin_site.name)  # type: ignore[attr-defined]


@admin.register(DurableActivity)
class DurableActivityAdmin(ReadOnlyAdmin):
    """Key decisions and other notable moments, kept for a week."""

    list_display = ("when", "kind", "workflow", "key", "run_link")
    list_filter = (KindFilter, WorkflowFilter)
    search_fields = ("key", "=run__id")
    ordering = ("-id",)
    show_full_result_count = False
    when = _column("at", "at", _when, "id")

    @admin.display(description="run")
    def run_link(self, entry: DurableActivity) -> Any:
        """The run the entry is about (it may have been pruned since)."""
        return _run_link(entry.run_id, self.admin_site.name)  # type: ignore[attr-defined]


@admin.register(DurableSchedule)
class DurableScheduleAdmin(ReadOnlyAdmin):
    """Keyed schedules' shared state: failures in a row, last outcome, enabled."""

    list_display = ("name", "workflow", "key", "schedule", "enabled", "failures", "last_outcome", "last_fire")
    list_filter = ("enabled", "workflow")
    search_fields = ("name", "key")
    ordering = ("name",)
    last_fire = _column("last fire", "last_fire_at", _when, "last_fire_at")
