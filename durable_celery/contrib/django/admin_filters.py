"""The admin's filters of runs: by the state of their key, and by a tag."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.contrib import admin
from django.db.models import Exists, OuterRef, QuerySet
from django.http import HttpRequest

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
