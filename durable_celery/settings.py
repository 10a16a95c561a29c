"""``Settings``: the tunables of one ``Durable``, from keywords, ``app.conf`` and the environment."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgument, InvalidDefinition
from .store.db import masked_url

log = logging.getLogger("durable_celery")

if TYPE_CHECKING:
    from celery import Celery

EMBEDDED_HOME = ".durable"


@dataclass(frozen=True)
class Settings:
    """Tunables of one ``Durable``; each may also be set as ``app.conf.durable_<name>``."""

    database_url: str | None = None
    # A streaming replica of the database for what operators read (dashboard, admin, reports,
    # metrics); starts, claims, results and anything followed by a write read the primary.
    read_database_url: str | None = None
    pool_size: int = 5
    # Behind PgBouncer in transaction mode (before 1.21): no server-side prepared statements.
    pgbouncer: bool = False
    heartbeat_interval: float = 10.0
    stale_lock_timeout: float = 300.0
    max_losses: int = 3
    relay_after: float = 120.0
    poll_interval: float = 1.0
    sweep_interval: float = 60.0
    backoff_base: float = 1.0
    backoff_max: float = 300.0
    publish_retries: int = 2
    # A start hands its message to a background thread instead of sending it before returning
    # (publisher.py); the run row is the outbox either way.
    publish_in_background: bool = True
    # While starts keep coming, the background thread waits up to this long (seconds) for more
    # before it sends, so one Redis round trip carries them; 0 sends each as soon as it can.
    publish_linger: float = 0.02
    shutdown_grace_period: float = 15.0
    missing_code_retry: float = 30.0
    upkeep: bool = True
    home: str = EMBEDDED_HOME
    # -- watching (logs.py, tracing.py, metrics.py) ---------------------------------------------
    # {"levels": [...], "metadata_filter": [...], "console": bool}, True (defaults) or False.
    log_capture: Any = None
    # An OpenTelemetry TracerProvider for step spans; None uses the global one.
    tracer_provider: Any = None
    # Serve Prometheus metrics on this port from each worker while it runs.
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"  # where metrics are served; "0.0.0.0" opens them to the network
    schedule_pickup_timeout: float = 900.0
    schedule_max_failures: int = 5
    # Retention (off by default): rule -> age, rules "completed", "cancelled", "failed" (prune.py).
    prune: Mapping[str, Any] | None = None
    prune_interval: float = 3600.0
    # A start whose input is larger than this as JSON (UTF-8 bytes) is refused (InvalidStart).
    max_input_bytes: int = 1_000_000
    # Inline continuation (continuation.py): a worker runs up to this many following steps of a
    # run in the task execution that ran its step (0: one broker message per step), for at
    # most inline_seconds, then publishes the next one.
    inline_steps: int = 20
    inline_seconds: float = 10.0
    # Priority ages (core/runs.py): a run of priority p waits in its limit's line as if it had
    # been started p * priority_aging seconds earlier.
    priority_aging: float = 60.0

    def __repr__(self) -> str:
        shown = []
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in ("database_url", "read_database_url") and isinstance(value, str):
                value = masked_url(value)  # a repr ends up in logs and tracebacks
            shown.append(f"{field.name}={value!r}")
        return f"Settings({', '.join(shown)})"

    @classmethod
    def build(cls, app: Celery, database_url: str | None, given: Mapping[str, Any]) -> Settings:
        """Settings from keyword arguments, then ``app.conf.durable_*``, then the environment."""
        names = {f.name for f in fields(cls)}
        unknown = set(given) - names
        if unknown:
            raise InvalidDefinition(f"unknown Durable setting(s): {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        for name in names:
            conf_value = app.conf.get(f"durable_{name}")
            if name in given:
                values[name] = given[name]
            elif conf_value is not None:
                values[name] = conf_value
        url = database_url or values.get("database_url") or os.environ.get("DURABLE_DATABASE_URL")
        values["database_url"] = url
        for name in ("home", "read_database_url"):  # DURABLE_HOME, DURABLE_READ_DATABASE_URL
            if values.get(name) is None and os.environ.get(f"DURABLE_{name.upper()}"):
                values[name] = os.environ[f"DURABLE_{name.upper()}"]
        settings = cls(**values)
        _check_positive(settings)
        _check_inline_steps(settings.inline_steps)
        _check_publish_linger(settings.publish_linger)
        limit = settings.schedule_max_failures
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidDefinition(f"schedule_max_failures must be a positive int, not {limit!r}")
        _check_max_input_bytes(settings.max_input_bytes)
        _check_metrics_addr(settings.metrics_addr)
        _check_metrics_port(settings.metrics_port)
        _check_read_database_url(settings.read_database_url, url)
        settings = replace(settings, prune=check_prune_rules(settings.prune))
        if settings.stale_lock_timeout < 3 * settings.heartbeat_interval:
            log.warning(
                "durable: stale_lock_timeout (%ss) is under 3 x heartbeat_interval (%ss): "
                "a slow heartbeat may hand a live step to another worker",
                settings.stale_lock_timeout,
                settings.heartbeat_interval,
            )
        if settings.database_url is None:
            path = os.path.abspath(os.path.join(settings.home, "durable.sqlite3"))
            settings = replace(settings, database_url=f"sqlite:///{path}")
        return settings


def _check_positive(settings: Settings) -> None:
    """The intervals and timeouts are positive numbers."""
    for name in (
        "heartbeat_interval",
        "stale_lock_timeout",
        "relay_after",
        "poll_interval",
        "sweep_interval",
        "backoff_base",
        "backoff_max",
        "shutdown_grace_period",
        "missing_code_retry",
        "schedule_pickup_timeout",
        "priority_aging",
        "prune_interval",
        "inline_seconds",
    ):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise InvalidDefinition(f"{name} must be a positive number, not {value!r}")


def _check_metrics_port(port: Any) -> None:
    """A port number, or None (no metrics served)."""
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise InvalidDefinition(f"metrics_port must be a port number, not {port!r}")


def _check_read_database_url(read_url: Any, url: str | None) -> None:
    """A read replica is a PostgreSQL URL, beside a PostgreSQL primary."""
    if read_url is None:
        return
    if not isinstance(read_url, str) or not read_url.startswith(("postgresql:", "postgresql+", "postgres:")):
        raise InvalidDefinition(
            f"read_database_url must be a PostgreSQL URL (a streaming replica), not {masked(read_url)}"
        )
    if not (url or "").startswith(("postgresql:", "postgresql+", "postgres:")):
        raise InvalidDefinition(
            "read_database_url needs a PostgreSQL database_url: it is that database's replica"
        )


def masked(value: Any) -> str:
    """A setting's value for a message: a URL's password hidden."""
    return repr(masked_url(value)) if isinstance(value, str) else repr(value)


def _check_inline_steps(steps: Any) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise InvalidDefinition(f"inline_steps must be an int >= 0, not {steps!r}")


def _check_publish_linger(linger: Any) -> None:
    if isinstance(linger, bool) or not isinstance(linger, (int, float)) or not 0 <= linger <= 1:
        raise InvalidDefinition(f"publish_linger must be a number of seconds from 0 to 1, not {linger!r}")


def _check_metrics_addr(addr: Any) -> None:
    if not isinstance(addr, str) or not addr.strip():
        raise InvalidDefinition(f"metrics_addr must be an address to listen on, not {addr!r}")


def _check_max_input_bytes(size: Any) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidDefinition(f"max_input_bytes must be a positive int of bytes, not {size!r}")


# -- the prune= rules (prune.py applies them) --------------------------------------------------

# A rule name and the statuses it covers: "failed" stands for every unsuccessful ending.
RULES: dict[str, tuple[str, ...]] = {
    "completed": ("completed",),
    "cancelled": ("cancelled",),
    "failed": ("failed", "compensated", "compensation_failed"),
}
_UNITS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_SECONDS = re.compile(r"\d+(?:\.\d+)?")  # a bare number is seconds, in text too (``--older-than 30``)


def parse_duration(value: Any, what: str = "duration") -> timedelta:
    """A positive duration from a timedelta, seconds (a number, or text like ``30``), or text like
    ``30d``, ``12h``, ``1d6h``."""
    seconds: float | None = None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if _SECONDS.fullmatch(text):
            seconds = float(text)
        elif text and _PART.sub("", text) == "":
            seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
    if seconds is None:
        raise InvalidArgument(
            f"{what} must be a timedelta, a number of seconds (30) or text like '30d', '12h', '90m', "
            f"'45s' or '2w', not {value!r}"
        )
    if not seconds > 0 or seconds == float("inf"):
        raise InvalidArgument(f"{what} must be positive, not {value!r}")
    return timedelta(seconds=seconds)


def format_duration(age: timedelta) -> str:
    """A duration as short text, the way :func:`parse_duration` reads it (``1d12h``)."""
    left, parts = age.total_seconds(), []
    for unit in "dhm":
        n, left = divmod(left, _UNITS[unit])
        if n:
            parts.append(f"{int(n)}{unit}")
    if left or not parts:
        parts.append(f"{left:g}s")
    return "".join(parts)


def check_prune_rules(rules: Any) -> dict[str, timedelta] | None:
    """The ``prune=`` setting checked and normalized: rule name -> age (None when off)."""
    if rules is None or rules == {}:
        return None
    if not isinstance(rules, Mapping):
        raise InvalidDefinition(
            f"prune must be a dict like {{'completed': timedelta(days=7)}}, not {rules!r}"
        )
    unknown = set(rules) - set(RULES)
    if unknown:
        raise InvalidDefinition(
            f"unknown prune rule(s) {', '.join(map(repr, sorted(map(str, unknown))))}; "
            f"use {', '.join(RULES)} ('failed' covers failed, compensated, compensation_failed)"
        )
    try:
        return {name: parse_duration(age, f"prune[{name!r}]") for name, age in rules.items()}
    except InvalidArgument as exc:
        raise InvalidDefinition(str(exc)) from None
