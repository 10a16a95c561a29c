"""Pages of long lists (runs, keys, activity): a page size and a cursor, the place of the last
row shown, to go on after it. Never an offset: a deep page would read every row before it.

Runs go newest first by their time-ordered id, so a run's id is the cursor of the runs after it
(``list_runs(..., after=run.id)``); activity entries by their growing id likewise.
"""

from __future__ import annotations

from typing import Any

from .errors import InvalidArgument

MAX_CURSOR = 200  # characters of a run id cursor, at most (ids are 36)


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
