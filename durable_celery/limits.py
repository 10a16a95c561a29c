"""Flow control options of a workflow: ``concurrency``, ``throttle`` and ``rate_limit``.

Each is ``{"limit": n, "period": seconds, "key": template-or-callable}`` (``concurrency`` has no
period; ``key`` is optional: without it one limit covers the whole workflow). They are checked
here when the workflow is defined; ``core/flow.py`` decides them against the database.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InvalidDefinition, InvalidStart

KINDS = ("concurrency", "throttle", "rate_limit")
MAX_KEY = 255


@dataclass(frozen=True)
class FlowLimit:
    """One flow-control option of a workflow: at most ``limit`` per key (per ``period``)."""

    kind: str
    limit: int
    period: float | None = None
    key: str | Callable[[dict[str, Any]], Any] | None = None

    @classmethod
    def parse(cls, kind: str, given: Any) -> FlowLimit | None:
        """The option as given to ``workflow(...)``; InvalidDefinition when malformed."""
        if given is None:
            return None
        if isinstance(given, FlowLimit):
            return given
        if not isinstance(given, Mapping):
            raise InvalidDefinition(f"{kind} takes a dict like {_example(kind)}, not {given!r}")
        allowed = {"limit", "key"} | ({"period"} if kind != "concurrency" else set())
        unknown = sorted(set(given) - allowed)
        if unknown:
            raise InvalidDefinition(f"{kind} takes {sorted(allowed)}, not {unknown[0]!r}: {_example(kind)}")
        limit = given.get("limit")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidDefinition(f"{kind} limit must be a positive int, not {limit!r}")
        period: float | None = None
        if kind != "concurrency":
            if "period" not in given:
                raise InvalidDefinition(f"{kind} needs a period in seconds: {_example(kind)}")
            period = _seconds(kind, given["period"])
        key = given.get("key")
        if key is not None and not (isinstance(key, str) or callable(key)):
            raise InvalidDefinition(
                f"{kind} key must be a template str or a callable on the input, not {key!r}"
            )
        return cls(kind, limit, period, key)

    def key_for(self, data: dict[str, Any], workflow: str | None) -> str:
        """This limit's key for a run's input ('' when the limit covers the whole workflow);
        InvalidStart when the template names a field the input lacks."""
        if self.key is None:
            return ""
        if callable(self.key):
            value = self.key(data)
        else:
            try:
                value = self.key.format(**data)
            except (KeyError, IndexError, AttributeError) as exc:
                raise InvalidStart(
                    f"workflow {workflow!r}: the {self.kind} key {self.key!r} needs {exc} in the input"
                ) from exc
        if not isinstance(value, str) or len(value) > MAX_KEY:
            raise InvalidStart(
                f"workflow {workflow!r}: the {self.kind} key must come to a str of at most {MAX_KEY} "
                f"characters, not {value!r}"
            )
        return value

    def describe(self) -> dict[str, Any]:
        """The option as shown by the dashboard and the CLI (a callable key by its name)."""
        key = self.key
        if callable(key):
            key = getattr(key, "__name__", "callable")
        shown: dict[str, Any] = {"limit": self.limit, "key": key}
        if self.period is not None:
            shown["period"] = self.period
        return shown


def _seconds(kind: str, value: Any) -> float:
    """A period: a positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise InvalidDefinition(f"{kind} period must be a positive number of seconds, not {value!r}")
    return float(value)


def _example(kind: str) -> str:
    if kind == "concurrency":
        return "{'limit': 2, 'key': 'tenant:{tenant}'}"
    return "{'limit': 10, 'period': 60, 'key': 'api:{customer}'}"
