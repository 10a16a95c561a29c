"""The dashboard's actions, shared by the page forms and the JSON API: each returns where to go
next and a one-line note of what happened."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from ..errors import DurableError, InvalidArgument
from .bulk import bulk_action

if TYPE_CHECKING:
    from ..app import Durable

RUN_ACTIONS = ("cancel", "retry", "rerun", "release-key", "event", "input")
QUEUE_ACTIONS = ("pause", "resume")
PATTERNS = [f"/runs/{{run_id}}/{a}" for a in RUN_ACTIONS]
PATTERNS += [f"/queues/{{name:path}}/{a}" for a in QUEUE_ACTIONS]
PATTERNS += ["/prune", "/runs/bulk"]


class BadRequest(DurableError, ValueError):
    """A form or body the action cannot use."""


def perform(
    durable: Durable, params: dict[str, Any], action: str, form: dict[str, Any], by: str, origin: str
) -> Any:
    """Do ``action`` on the run or queue in ``params``; (page to show next, note). ``by`` (who:
    ``dashboard`` or ``api``) and ``origin`` (the client's address) go on the run's activity."""
    if action == "bulk":
        return bulk_action(durable, form, by, origin)
    if "run_id" in params:
        return run_action(durable, params["run_id"], action, form, by, origin)
    if "name" in params:
        return queue_action(durable, params["name"], action)
    return "/settings", prune_now(durable)


def run_action(
    durable: Durable, run_id: str, action: str, form: dict[str, Any], by: str, origin: str
) -> tuple[str, str]:
    """cancel, retry, rerun, release-key, event or input on one run."""
    page = f"/runs/{quote(run_id)}"
    durable.get_run(run_id)  # RunNotFound before anything else
    handlers: dict[str, Callable[[], tuple[str, str]]] = {
        "cancel": lambda: (
            page,
            "cancelled" if durable.cancel(run_id, by=by, origin=origin) else "already finished",
        ),
        "retry": lambda: (page, f"retrying {durable.retry(run_id, by=by, origin=origin)}"),
        "rerun": lambda: _rerun(durable, run_id),
        "release-key": lambda: _release(durable, run_id, f"{by} from {origin}", page),
        "event": lambda: _event(durable, run_id, form, page),
        "input": lambda: _input(durable, run_id, form, page),
    }
    return handlers[action]()


def _rerun(durable: Durable, run_id: str) -> tuple[str, str]:
    new_id = durable.rerun(run_id)
    return f"/runs/{quote(new_id)}", f"rerun of {run_id} as {new_id}"


def _release(durable: Durable, run_id: str, by: str, page: str) -> tuple[str, str]:
    durable.release_key(run_id, by=by)
    return page, "key released"


def _event(durable: Durable, run_id: str, form: dict[str, Any], page: str) -> tuple[str, str]:
    name = _name(form)
    payload = _value(form.get("payload"))
    buffer = str(form.get("buffer", "")).lower() in ("1", "true", "on", "yes")
    delivered = durable.send_event(run_id, name, payload, buffer=buffer)
    return (
        page,
        f"event {name} {'delivered' if delivered else 'not delivered (the run does not wait for it)'}",
    )


def _input(durable: Durable, run_id: str, form: dict[str, Any], page: str) -> tuple[str, str]:
    name = _name(form)
    given = durable.provide_input(run_id, name, _value(form.get("value")))
    return page, f"input {name} {'given' if given else 'kept until the run waits for it'}"


def _name(form: dict[str, Any]) -> str:
    name = form.get("name")
    if not isinstance(name, str) or not name.strip():
        raise BadRequest("give the event or input a name")
    return name.strip()


def _value(raw: Any) -> Any:
    """A form's JSON text as a value (empty: None); a JSON body's value as it is."""
    if not isinstance(raw, str):
        return raw
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        raise BadRequest(f'not JSON: {raw[:80]!r} (quote text: "like this")') from None


def queue_action(durable: Durable, name: str, action: str) -> tuple[str, str]:
    """pause or resume a queue."""
    if action == "pause":
        durable.pause_queue(name)
        return "/queues", f"queue {name} paused"
    if action == "resume":
        sent = durable.resume_queue(name)
        return "/queues", f"queue {name} resumed; {sent} ready run(s) sent again"
    raise InvalidArgument(f"unknown queue action {action!r}")


def prune_now(durable: Durable) -> str:
    """Run the prune rules now; a note of what each deleted."""
    if not durable.settings.prune:
        raise BadRequest("no prune rules are configured (Durable(app, prune={...}))")
    counts = durable.prune()
    return "pruned: " + ", ".join(f"{rule} {n}" for rule, n in counts.items())
