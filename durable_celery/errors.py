"""Exceptions raised by durable_celery; every one derives from ``DurableError``."""

from __future__ import annotations


class DurableError(Exception):
    """Base class of every durable_celery error."""


class NotConfigured(DurableError):
    """No ``Durable`` is bound to the Celery app in use."""


class MissingExtra(NotConfigured):
    """A feature needs an optional dependency that is not installed: the message says how to
    install it, for a package installed from an index and for a checkout alike."""

    def __init__(self, extra: str, what: str, reason: str = "") -> None:
        self.extra = extra
        hint = f"pip install 'durable-celery[{extra}]'"
        if _in_checkout():
            hint += f" (in this checkout: pip install -e '.[{extra}]')"
        super().__init__(f"{what} needs the {extra} extra: {hint}" + (f" ({reason})" if reason else ""))


def _in_checkout() -> bool:
    """Whether this package runs from a source checkout (its pyproject.toml next to it)."""
    from pathlib import Path

    project = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        return 'name = "durable-celery"' in project.read_text(encoding="utf-8")
    except OSError:
        return False


class InvalidDefinition(DurableError, ValueError):
    """A workflow or step was defined with options that cannot work."""


class InvalidArgument(DurableError, ValueError):
    """A call got an argument it cannot use; nothing was written."""


class InvalidStart(InvalidArgument):
    """A start was refused before anything was written."""


class InvalidKey(InvalidStart):
    """A workflow key is not ``None`` or a str of 1 to 255 UTF-8 bytes."""


class UnknownWorkflow(InvalidStart):
    """No workflow of that name is defined."""


class KeyTaken(DurableError):
    """The key is held by another run; ``holder_id`` names it. A start refused by
    ``on_duplicate="error"`` also says whether its input differs from the holder's
    (``input_changed``, JSON equality) and the holder's ``holder_status``; None elsewhere."""

    def __init__(
        self,
        holder_id: str,
        message: str | None = None,
        *,
        input_changed: bool | None = None,
        holder_status: str | None = None,
    ) -> None:
        self.holder_id = holder_id
        self.input_changed = input_changed
        self.holder_status = holder_status
        super().__init__(message or f"key is held by run {holder_id}")


class RateLimited(DurableError):
    """A start beyond a workflow's ``rate_limit`` for its key; nothing was written.
    ``retry_after``: seconds until a start of that key would be accepted."""

    def __init__(self, workflow: str, key: str, limit: int, period: float, retry_after: float) -> None:
        self.workflow, self.key, self.limit, self.period = workflow, key, limit, period
        self.retry_after = retry_after
        shown = f" for {key!r}" if key else ""
        super().__init__(
            f"workflow {workflow!r} takes at most {limit} start(s) per {period:g}s{shown}; "
            f"try again in {retry_after:.1f}s"
        )


class KeyContended(DurableError):
    """The key changed hands three times while one start ran; trying again is safe."""


class NotFinished(DurableError):
    """The run is still going; cancel it first."""


class NoKey(DurableError):
    """The run does not hold a key."""


class RunNotFound(DurableError, LookupError):
    """No run has that id."""

    def __init__(self, run_id: object) -> None:
        self.run_id = run_id
        super().__init__(f"no run with id {run_id!r}")


class ScheduleNotFound(DurableError, LookupError):
    """No schedule has that name."""

    def __init__(self, name: object) -> None:
        self.name = name
        super().__init__(f"no schedule named {name!r}")


class DatabaseUnavailable(DurableError):
    """The database could not be reached, or dropped the connection during the call."""

    def __init__(self, url: str, reason: str) -> None:
        self.url, self.reason = url, reason  # url with its password masked; the driver's first line
        super().__init__(
            f"database unavailable at {url} ({reason}); check that the server is running and "
            "reachable from this host and that the URL is right, then try again"
        )

    def __reduce__(self) -> tuple[type[DatabaseUnavailable], tuple[str, str]]:
        return (type(self), (self.url, self.reason))

    @property
    def misconfigured(self) -> bool:
        """Whether the URL, not an outage, is at fault (no such database or user, a password
        refused, SSL the server does not speak): waiting will not help."""
        reason = self.reason
        return (
            "does not exist" in reason
            or "authentication failed" in reason
            or "no password supplied" in reason
            or "SSL" in reason
            or "certificate" in reason
        )

    @property
    def fix(self) -> str:
        """What to do about it, in a few words."""
        reason = self.reason
        if "database" in reason and "does not exist" in reason:
            return "create that database (createdb NAME) or fix the database name in the URL"
        if ("role" in reason and "does not exist" in reason) or "authentication failed" in reason:
            return "check the user and password in the URL given to Durable(app, ...)"
        if "does not support SSL" in reason:
            return (
                "the server accepts no SSL connections: enable ssl on the server, or remove the sslmode "
                "parameter from the URL where the network is trusted"
            )
        if "SSL" in reason or "certificate" in reason:
            return "check sslmode and the certificate files (sslrootcert, sslcert, sslkey) in the URL"
        return (
            "check that the server is running and reachable from this host, and the host and port in the URL"
        )


class SchemaOutdated(DurableError):
    """The database has no durable schema, or one older than this code: migrate it."""

    FIX = "run `celery -A <app> durable migrate` (Django: `python manage.py migrate`)"

    def __init__(self, url: str, reason: str, fix: str | None = None) -> None:
        # url with its password masked; the driver's first line; the project's own fix, if known
        self.url, self.reason, self.fix = url, reason, fix or self.FIX
        super().__init__(
            f"the database at {url} has no durable schema, or one older than this code ({reason}); {self.fix}"
        )

    def __reduce__(self) -> tuple[type[SchemaOutdated], tuple[str, str, str]]:
        return (type(self), (self.url, self.reason, self.fix))


class Unsupported(DurableError):
    """The storage backend lacks a capability the call needs."""


class RunStopped(BaseException):
    """Raised inside a step to stop it: the run was cancelled, fenced or timed out.

    It derives from BaseException so that a step's own ``except Exception`` cannot swallow it.
    """

    def __init__(self, reason: str = "stopped") -> None:
        self.reason = reason
        super().__init__(reason)


class StepTimeout(DurableError):
    """A step ran longer than its ``timeout``."""


class ChildFailed(DurableError):
    """A child workflow or parallel branch ended without completing."""

    def __init__(self, child_id: str, status: str, error: dict[str, object] | None) -> None:
        self.child_id, self.status, self.error = child_id, status, error
        reason = (error or {}).get("message") or status
        super().__init__(f"child run {child_id} ended {status}: {reason}")


class RunFailed(DurableError):
    """``result`` of a run that ended without its output: failed (after its retries),
    compensated or compensation_failed; ``error_type`` and ``error_message`` are its error's."""

    def __init__(self, run_id: str, status: str, error: dict[str, object] | None) -> None:
        self.run_id, self.status = run_id, status
        self.error_type = str((error or {}).get("type") or status)
        self.error_message = str((error or {}).get("message") or "")
        super().__init__(f"run {run_id} ended {status}: {self.error_type}: {self.error_message}")

    def __reduce__(self) -> tuple[type[RunFailed], tuple[str, str, dict[str, object]]]:
        return (
            type(self),
            (self.run_id, self.status, {"type": self.error_type, "message": self.error_message}),
        )


class RunCancelled(DurableError):
    """``result`` of a run that was cancelled (``reason``: its error's message, if any)."""

    def __init__(self, run_id: str, reason: str = "") -> None:
        self.run_id, self.reason = run_id, reason
        super().__init__(f"run {run_id} was cancelled" + (f": {reason}" if reason else ""))

    def __reduce__(self) -> tuple[type[RunCancelled], tuple[str, str]]:
        return (type(self), (self.run_id, self.reason))


class ResultTimeout(DurableError, TimeoutError):
    """``result`` waited ``timeout`` seconds and the run had not ended; the run goes on."""

    def __init__(self, run_id: str, timeout: float, status: str) -> None:
        self.run_id, self.timeout, self.status = run_id, timeout, status
        super().__init__(f"run {run_id} is still {status} after {timeout}s (it goes on)")

    def __reduce__(self) -> tuple[type[ResultTimeout], tuple[str, float, str]]:
        return (type(self), (self.run_id, self.timeout, self.status))


class WorkerLost(DurableError):
    """The process running a step died (killed, out of memory): the attempt is used."""


class Terminated(WorkerLost):
    """A Celery control command (``terminate``, ``revoke --terminate``) stopped the process
    running a step: the attempt is used."""


class EventTimeout(DurableError):
    """A wait for an event (or input) timed out and no ``timeout_value`` was given."""


__all__ = [
    "DurableError",
    "NotConfigured",
    "InvalidDefinition",
    "InvalidArgument",
    "InvalidStart",
    "InvalidKey",
    "UnknownWorkflow",
    "KeyTaken",
    "KeyContended",
    "RateLimited",
    "NotFinished",
    "NoKey",
    "RunNotFound",
    "ScheduleNotFound",
    "DatabaseUnavailable",
    "Unsupported",
    "RunStopped",
    "StepTimeout",
    "ChildFailed",
    "RunFailed",
    "RunCancelled",
    "ResultTimeout",
    "WorkerLost",
    "Terminated",
    "EventTimeout",
]
