"""The admin's filters, search and paginator: runs by the state of their key and by a tag, rows
by a workflow, status, phase or kind (bounded reads), runs searched by exact id or key (indexes),
and a count that stops at 10,000."""

from __future__ import annotations

from collections import Counter
from functools import cached_property
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.http import HttpRequest

from ...errors import DurableError
from ...store import dashboard_rows
from ...store.schema import FINISHED, UNFINISHED
from .durable import durable_for
from .models import DurableKey, DurableRun

TAG_SAMPLE = 1000  # the newest tagged runs whose tags the filter offers
TAGS_OFFERED = 20


class KeyFilter(admin.SimpleListFilter):
    """Runs by key: those with one key (``?key=...``, as each key in the list links), those
    holding their key, those that hold it no more, those started without one."""

    title = "key"
    parameter_name = "key_is"
    states = (("holding", "holding its key"), ("released", "not holding its key"), ("none", "no key"))

    def lookups(self, request: HttpRequest, model_admin: Any) -> Any:
        """The three states of a run's key."""
        return self.states

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """The runs in the chosen state."""
        holds = Exists(DurableKey.objects.filter(holder_id=OuterRef("pk")))
        if self.value() == "holding":
            return queryset.filter(holds)
        if self.value() == "released":
            return queryset.filter(key__isnull=False).exclude(holds)
        if self.value() == "none":
            return queryset.filter(key__isnull=True)
        return queryset


class TagFilter(admin.SimpleListFilter):
    """Runs carrying a tag (``?tag=tenant=acme``, any tag by URL): the filter offers the tags
    most common among the newest tagged runs (a bounded read)."""

    title = "tag"
    parameter_name = "tag"

    def lookups(self, request: HttpRequest, model_admin: Any) -> Any:
        """The most common ``name=value`` pairs of the newest tagged runs, and the one chosen."""
        newest = DurableRun.objects.filter(tags__isnull=False).order_by("-pk").values_list("tags", flat=True)
        seen = Counter(f"{k}={v}" for tags in newest[:TAG_SAMPLE] for k, v in (tags or {}).items())
        offered = [pair for pair, _count in seen.most_common(TAGS_OFFERED)]
        chosen = self.value()
        if chosen and chosen not in offered:
            offered.append(chosen)
        return [(pair, pair) for pair in sorted(offered)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """The runs carrying the chosen tag (containment: the tags' GIN index)."""
        chosen = self.value()
        if not chosen:
            return queryset
        name, _sep, value = chosen.partition("=")
        return queryset.filter(tags__contains={name: value})


NAMES_SAMPLE = 1000  # the newest rows whose workflow names (or kinds) a filter offers
COUNT_CAP = 10_000  # rows a changelist counts at most (its page count stops there)


class CappedPaginator(Paginator):  # type: ignore[type-arg]
    """The changelist's paginator: counts at most ``COUNT_CAP + 1`` rows (``SELECT count(*)``
    of a ``LIMIT``ed subquery, in no order: the planner reads whichever index the filter has,
    not the newest rows by id until it has met enough), never a whole table of millions of runs."""

    @cached_property
    def count(self) -> int:
        """Rows of the list, up to ``COUNT_CAP + 1`` (more: "10,001" reads as at least that)."""
        return int(self.object_list.order_by()[: COUNT_CAP + 1].count())


class ValueFilter(admin.SimpleListFilter):
    """Rows whose ``field`` is the chosen value, offering fixed ``offered`` values or the values of the
    newest rows (a bounded read, where Django's own filter reads every distinct value of the
    column: a whole index of millions of rows)."""

    field = ""
    offered: tuple[str, ...] = ()

    def lookups(self, request: HttpRequest, model_admin: Any) -> Any:
        """The offered values, and the one chosen."""
        offered = set(self.offered or self.newest(model_admin.get_queryset(request)))
        if self.value():
            offered.add(str(self.value()))
        return [(value, value) for value in sorted(offered)]

    def newest(self, queryset: QuerySet[Any]) -> set[str]:
        """The values of the field on the newest ``NAMES_SAMPLE`` rows."""
        values = queryset.order_by("-pk").values_list(self.field, flat=True)[:NAMES_SAMPLE]
        return {value for value in values if value}

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """The rows with the chosen value."""
        return queryset.filter(**{self.field: self.value()}) if self.value() else queryset


class WorkflowFilter(ValueFilter):
    """By workflow: the workflows of the newest rows."""

    title = parameter_name = field = "workflow"


class RunStatusFilter(ValueFilter):
    """By a run's status: each of the nine."""

    title = parameter_name = field = "status"
    offered = UNFINISHED + FINISHED


class StepStatusFilter(ValueFilter):
    """By a step attempt's outcome."""

    title = parameter_name = field = "status"
    offered = ("completed", "failed")


class PhaseFilter(ValueFilter):
    """Step attempts or compensations."""

    title = parameter_name = field = "phase"
    offered = ("step", "compensate")


class KindFilter(ValueFilter):
    """By the kind of activity entry: the kinds of the newest entries."""

    title = parameter_name = field = "kind"


class RunSearch:
    """The runs changelist's search: a run by its exact id, or the runs of an exact key, looked
    up per stored workflow (the key index leads with the workflow: a key alone would read every
    run)."""

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any], search_term: str) -> Any:
        """The runs whose id or key is the term; no duplicates to remove."""
        term = search_term.strip()
        if not term:
            return queryset, False
        try:
            with durable_for(queryset.db).reads.engine.connect() as conn:
                names = dashboard_rows.workflow_names(conn)
        except DurableError:  # no DjangoDurable made on this alias: the key alone
            return queryset.filter(Q(pk=term) | Q(key=term)), False
        return queryset.filter(Q(pk=term) | Q(workflow__in=names, key=term)), False
