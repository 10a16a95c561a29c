"""The admin's run actions on "all N matching": Django's "select all" (``select_across``) goes
durable's bulk path (``durable.bulk``: keyset pages, a transaction per run, every per-run rule,
one ``bulk`` activity entry naming the user, the filter and the counts) when every filter of the
changelist is one ``bulk`` takes (workflow, status, tag, created). A search or the key filter
has no bulk twin: the action then goes over the matching rows one by one, as for a selection."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from django.contrib import messages
from django.http import HttpRequest
from django.utils import timezone

from ...errors import DurableError
from .durable import durable_for

NOT_FILTERS = frozenset({"o", "p", "e", "_changelist_filters", "_popup", "_to_field"})


def _moment(value: str) -> datetime:
    """A date filter's bound (``created_at__gte=2026-12-05 00:00:00+00:00``), aware."""
    moment = datetime.fromisoformat(value)
    return moment if moment.tzinfo else timezone.make_aware(moment)


def _tag(filters: dict[str, Any], value: str) -> None:
    name, sep, tag_value = value.partition("=")
    if not sep:
        raise ValueError(f"a tag filter is name=value, not {value!r}")
    filters.setdefault("tags", {})[name] = tag_value


_TAKEN: dict[str, Callable[[dict[str, Any], str], None]] = {
    "workflow": lambda f, v: f.__setitem__("workflow", v),
    "status": lambda f, v: f.__setitem__("status", v),
    "tag": _tag,
    "created_at__gte": lambda f, v: f.__setitem__("since", _moment(v)),
    "created_at__lt": lambda f, v: f.__setitem__("until", _moment(v)),
}


def bulk_filters(params: Mapping[str, str]) -> dict[str, Any] | None:
    """The changelist's filters (its query string) as ``bulk``'s, or None when one of them has
    no bulk twin (a search, the key filter) or cannot be read."""
    filters: dict[str, Any] = {}
    for name, value in params.items():
        if name in NOT_FILTERS or value == "":
            continue
        take = _TAKEN.get(name)
        if take is None:
            return None
        try:
            take(filters, value)
        except ValueError:
            return None
    return filters


def all_matching(action: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate an admin run action: on "all N matching", ``durable.bulk(action)`` with the
    changelist's filters, by the admin user, and one message with the report."""

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def act(model_admin: Any, request: HttpRequest, queryset: Any) -> Any:
            filters = bulk_filters(request.GET) if request.POST.get("select_across") == "1" else None
            if filters is None:
                return method(model_admin, request, queryset)
            by = f"django admin: {request.user.get_username()}"
            try:
                report = durable_for(queryset.db).bulk(action, by=by, **filters)
            except DurableError as exc:
                model_admin.message_user(request, f"{type(exc).__name__}: {exc}", messages.ERROR)
                return None
            model_admin.message_user(request, report.summary().capitalize(), messages.SUCCESS)
            return None

        return act

    return decorate
