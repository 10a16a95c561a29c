"""Flow control options of a workflow: ``concurrency``, ``throttle`` and ``rate_limit``.

Each is ``{"limit": n, "period": seconds, "key": template-or-callable}`` (``concurrency`` has no
period; ``key`` is optional: without it one limit covers the whole workflow). ``concurrency`` may
also share its slots across fair keys: ``"fair": template-or-callable`` and ``"weights": {fair
key: share}`` (or a callable on the fair key; default 1). They are checked here when the workflow
is defined; ``core/flow.py`` decides them against the database. ``batch`` (``Batch``) gathers
starts into one run (``core/batches.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InvalidDefinition, InvalidStart

KINDS = ("concurrency", "throttle", "rate_limit")
MAX_KEY = 255
MAX_WEIGHT = 1000
MAX_PRIORITY = 1000


def check_priority(value: Any, error: type[Exception]) -> int:
    """A priority: an int from -1000 to 1000 (0 the default, higher first); ``error`` otherwise."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise error(f"priority must be an int from {-MAX_PRIORITY} to {MAX_PRIORITY}, not {value!r}")
    return value


@dataclass(frozen=True)
class FlowLimit:
    """One flow-control option of a workflow: at most ``limit`` per key (per ``period``)."""

    kind: str
    limit: int
    period: float | None = None
    key: str | Callable[[dict[str, Any]], Any] | None = None
    fair: str | Callable[[dict[str, Any]], Any] | None = None  # concurrency: the fair key
    weights: Mapping[str, float] | Callable[[str], Any] | None = None

    @classmethod
    def parse(cls, kind: str, given: Any) -> FlowLimit | None:
        """The option as given to ``workflow(...)``; InvalidDefinition when malformed."""
        if given is None:
            return None
        if isinstance(given, FlowLimit):
            return given
        if not isinstance(given, Mapping):
            raise InvalidDefinition(f"{kind} takes a dict like {_example(kind)}, not {given!r}")
        allowed = {"limit", "key"} | ({"period"} if kind != "concurrency" else {"fair", "weights"})
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
        key, fair = given.get("key"), given.get("fair")
        for name, value in (("key", key), ("fair", fair)):
            if value is not None and not (isinstance(value, str) or callable(value)):
                raise InvalidDefinition(
                    f"{kind} {name} must be a template str or a callable on the input, not {value!r}"
                )
        weights = _weights(given.get("weights"), fair)
        return cls(kind, limit, period, key, fair, weights)

    def key_for(self, data: dict[str, Any], workflow: str | None) -> str:
        """This limit's key for a run's input ('' when the limit covers the whole workflow);
        InvalidStart when the template names a field the input lacks."""
        return _derive(self.key, data, workflow, f"{self.kind} key")

    def fair_key_for(self, data: dict[str, Any], workflow: str | None) -> str | None:
        """The run's fair key (None without ``fair``); InvalidStart as ``key_for``."""
        return None if self.fair is None else _derive(self.fair, data, workflow, f"{self.kind} fair key")

    def weight_of(self, fair_key: str, workflow: str | None) -> float:
        """The share of ``fair_key`` (1 unless ``weights`` says otherwise); InvalidStart when a
        callable gives no positive number."""
        weights = self.weights
        if weights is None:
            return 1.0
        value = weights(fair_key) if callable(weights) else weights.get(fair_key, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_WEIGHT:
            raise InvalidStart(
                f"workflow {workflow!r}: the weight of fair key {fair_key!r} must be a number in "
                f"(0, {MAX_WEIGHT}], not {value!r}"
            )
        return float(value)

    def describe(self) -> dict[str, Any]:
        """The option as shown by the dashboard and the CLI (a callable key by its name)."""
        key = self.key
        if callable(key):
            key = getattr(key, "__name__", "callable")
        shown: dict[str, Any] = {"limit": self.limit, "key": key}
        if self.period is not None:
            shown["period"] = self.period
        if self.fair is not None:
            shown["fair"] = (
                self.fair if isinstance(self.fair, str) else getattr(self.fair, "__name__", "callable")
            )
            if self.weights is not None:
                shown["weights"] = (
                    dict(self.weights)
                    if isinstance(self.weights, Mapping)
                    else getattr(self.weights, "__name__", "callable")
                )
        return shown


def _derive(template: Any, data: dict[str, Any], workflow: str | None, what: str) -> str:
    """A key from its template or callable ('' for None); InvalidStart if it needs a field the
    input lacks or does not come to a short str."""
    if template is None:
        return ""
    if callable(template):
        value = template(data)
    else:
        try:
            value = template.format(**data)
        except (KeyError, IndexError, AttributeError) as exc:
            raise InvalidStart(
                f"workflow {workflow!r}: the {what} {template!r} needs {exc} in the input"
            ) from exc
    if not isinstance(value, str) or len(value) > MAX_KEY:
        raise InvalidStart(
            f"workflow {workflow!r}: the {what} must come to a str of at most {MAX_KEY} "
            f"characters, not {value!r}"
        )
    return value


def _weights(given: Any, fair: Any) -> Mapping[str, float] | Callable[[str], Any] | None:
    """``weights`` as given: a dict of fair key to a positive share, or a callable; only with ``fair``."""
    if given is None:
        return None
    if fair is None:
        raise InvalidDefinition(
            "concurrency weights need a fair key: {'limit': 20, 'fair': 'tenant:{tenant}', ...}"
        )
    if callable(given):
        return given  # type: ignore[no-any-return]
    if not isinstance(given, Mapping):
        raise InvalidDefinition(
            f"concurrency weights take a dict of fair key to share, or a callable, not {given!r}"
        )
    for name, share in given.items():
        if not isinstance(name, str) or isinstance(share, bool) or not isinstance(share, (int, float)):
            raise InvalidDefinition(f"concurrency weights: {name!r}: {share!r} is not a str key and a number")
        if not 0 < share <= MAX_WEIGHT:
            raise InvalidDefinition(
                f"concurrency weights: the share of {name!r} must be in (0, {MAX_WEIGHT}]"
            )
    return {name: float(share) for name, share in given.items()}


def _seconds(kind: str, value: Any) -> float:
    """A period: a positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise InvalidDefinition(f"{kind} period must be a positive number of seconds, not {value!r}")
    return float(value)


def _example(kind: str) -> str:
    if kind == "concurrency":
        return "{'limit': 2, 'key': 'tenant:{tenant}'}"
    return "{'limit': 10, 'period': 60, 'key': 'api:{customer}'}"


MAX_BATCH = 10_000


@dataclass(frozen=True)
class Batch:
    """A workflow's ``batch`` option: starts with one batch key within ``period`` seconds of the
    first (at most ``max``) are gathered into one run whose steps get ``items=[input, ...]``."""

    max: int
    period: float
    key: str | Callable[[dict[str, Any]], Any] | None = None

    @classmethod
    def parse(
        cls, given: Any, key: Any = None, debounce: Any = None, idempotency: str = "optional"
    ) -> Batch | None:
        """The option as given to ``workflow(batch=...)``; InvalidDefinition when malformed or
        combined with a workflow key, a debounce or ``idempotency="required"``."""
        if given is None or isinstance(given, Batch):
            return given
        example = "{'max': 100, 'period': 5, 'key': 'invoice:{customer}'}"
        if not isinstance(given, Mapping):
            raise InvalidDefinition(f"batch takes a dict like {example}, not {given!r}")
        unknown = sorted(set(given) - {"max", "period", "key"})
        if unknown:
            raise InvalidDefinition(f"batch takes ['key', 'max', 'period'], not {unknown[0]!r}: {example}")
        most = given.get("max")
        if isinstance(most, bool) or not isinstance(most, int) or not 2 <= most <= MAX_BATCH:
            raise InvalidDefinition(f"batch max must be an int from 2 to {MAX_BATCH}, not {most!r}")
        if "period" not in given:
            raise InvalidDefinition(f"batch needs a period in seconds: {example}")
        batch_key = given.get("key")
        if batch_key is not None and not (isinstance(batch_key, str) or callable(batch_key)):
            raise InvalidDefinition(
                f"batch key must be a template str or a callable on the input, not {batch_key!r}"
            )
        for clash, said in ((key, "a workflow key"), (debounce, "debounce")):
            if clash is not None:
                raise InvalidDefinition(
                    f"batch cannot be combined with {said}: a batch's run gathers many starts, "
                    "a key or a debounce answers them with one; use the batch key instead"
                )
        if idempotency == "required":
            raise InvalidDefinition(
                "batch cannot be combined with idempotency='required' (its starts take no key)"
            )
        return cls(most, _seconds("batch", given["period"]), batch_key)

    def key_for(self, data: dict[str, Any], workflow: str | None) -> str:
        """The batch key of a start's input ('' without ``key``: one batch for the workflow)."""
        return _derive(self.key, data, workflow, "batch key")

    def describe(self) -> dict[str, Any]:
        """The option as shown by the dashboard and the CLI (a callable key by its name)."""
        key = self.key if not callable(self.key) else getattr(self.key, "__name__", "callable")
        return {"max": self.max, "period": self.period, "key": key}
