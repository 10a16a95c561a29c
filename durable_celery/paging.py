"""Pages of long lists (runs, keys, activity): a page size and a cursor, the place of the last
row shown, to go on after it. Never an offset: a deep page would read every row before it.

Runs go newest first by their time-ordered id, so a run's id is the cursor of the runs after it
(``list_runs(..., after=run.id)``); activity entries and a run's steps by their growing id
likewise. Keys go newest taken first, ties by workflow and key: their cursor is those three,
made one opaque URL-safe string (``list_keys(..., after=entry.cursor)``).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from datetime import datetime, timezone
from typing import Any

from .errors import InvalidArgument

MAX_CURSOR = 200  # characters of a run id cursor, at most (ids are 36)
# Characters of a key cursor, at most: a workflow name (200 characters) and a key (255 bytes),
# JSON-escaped, with the time, in base64.
MAX_KEY_CURSOR = 2400
_URL_SAFE = re.compile(r"[A-Za-z0-9_-]+")


def check_limit(limit: Any) -> int:
    """A page size: a positive int, else InvalidArgument."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgument(f"limit must be a positive int, not {limit!r}")
    return limit


def check_after(after: Any) -> str | None:
    """A run id cursor (``after=``): None or a non-empty str, else InvalidArgument."""
    if after is None:
        return None
    if not isinstance(after, str) or not 0 < len(after) <= MAX_CURSOR:
        raise InvalidArgument(f"after must be the id of the last run of the page before, not {after!r}")
    return after


def check_after_id(after: Any) -> int | None:
    """An activity entry cursor (``after=``): None or the id (a positive int) of the last entry."""
    if after is None:
        return None
    if isinstance(after, bool) or not isinstance(after, int) or after < 1:
        raise InvalidArgument(f"after must be the id of the last entry of the page before, not {after!r}")
    return after


def key_cursor(taken_at: datetime, workflow: str, key: str) -> str:
    """The cursor of a key row: where the keys after it (taken earlier) start."""
    if taken_at.tzinfo is None:  # SQLite's times are naive; every stored time is UTC
        taken_at = taken_at.replace(tzinfo=timezone.utc)
    place = [taken_at.astimezone(timezone.utc).isoformat(), workflow, key]
    raw = json.dumps(place, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def check_key_cursor(value: Any) -> tuple[datetime, str, str] | None:
    """A key cursor (``after=``): None, or the (taken_at, workflow, key) that ``key_cursor``
    made it of; InvalidArgument for anything else."""
    if value is None:
        return None
    place = _decode_key_cursor(value)
    if not (isinstance(place, list) and len(place) == 3 and all(isinstance(p, str) and p for p in place)):
        raise _bad_key_cursor(value)
    try:
        taken_at = datetime.fromisoformat(place[0])
    except ValueError:
        raise _bad_key_cursor(value) from None
    if taken_at.tzinfo is None:
        taken_at = taken_at.replace(tzinfo=timezone.utc)
    return taken_at, place[1], place[2]


def _decode_key_cursor(value: Any) -> Any:
    """The JSON a key cursor carries, or InvalidArgument when it is no such string."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_KEY_CURSOR or not _URL_SAFE.fullmatch(value):
        raise _bad_key_cursor(value)
    try:
        return json.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode("utf-8"))
    except (binascii.Error, ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise _bad_key_cursor(value) from None


def _bad_key_cursor(value: Any) -> InvalidArgument:
    shown = value if not isinstance(value, str) or len(value) <= 80 else value[:80] + "..."
    return InvalidArgument(
        f"after must be the cursor of the last key of the page before (KeyEntry.cursor), not {shown!r}"
    )
