"""What a start may be given: a key (``check_key``) and an input (``check_input``): checked
before anything is written, with the field's place named in the error."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from .errors import InvalidKey, InvalidStart

MAX_KEY_BYTES = 255
# Levels of nested mappings and lists an input may have (the input itself is level 1): deeper
# input is refused at start, before the JSON encoder or a driver recurses into it.
MAX_INPUT_DEPTH = 64


def check_key(key: Any) -> str | None:
    """Return ``key`` if it is None or a str of 1..255 UTF-8 bytes, else raise InvalidKey."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise InvalidKey(f"a key must be a str or None, not {type(key).__name__}")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidKey(
            f"a key must be valid UTF-8: {key!r} has a lone surrogate at character {exc.start}"
        ) from exc
    if not 1 <= size <= MAX_KEY_BYTES:
        raise InvalidKey(f"a key must be 1 to {MAX_KEY_BYTES} UTF-8 bytes, got {size}")
    if "\x00" in key:
        raise InvalidKey(f"a key must not contain a NUL character (\\x00): {key!r}; remove it")
    return key


def check_input(data: Any, max_bytes: int | None = None) -> dict[str, Any]:
    """Return the run input as a dict of JSON values, or raise InvalidStart.

    Refused: anything but a mapping with str field names; values JSON cannot hold (NaN and the
    infinities named with their field's place); text with a
    NUL character or a lone surrogate (neither PostgreSQL nor UTF-8 can store them); nesting
    deeper than ``MAX_INPUT_DEPTH``; more than ``max_bytes`` bytes of JSON (when given).
    """
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise InvalidStart(f"a run's input must be a mapping of keyword arguments, not {type(data).__name__}")
    if not all(isinstance(k, str) for k in data):
        raise InvalidStart("a run's input must have str keys")
    _check_values(data)
    try:
        text = json.dumps(dict(data), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidStart(f"a run's input must be JSON: {exc}") from exc
    if max_bytes is not None:
        size = len(text.encode("utf-8"))
        if size > max_bytes:
            raise InvalidStart(
                f"a run's input is {size:,} bytes as JSON, over max_input_bytes ({max_bytes:,}): keep "
                "large data elsewhere (a file, a table) and pass its name or id"
            )
    return json.loads(text)  # type: ignore[no-any-return]


def _check_values(data: Mapping[str, Any]) -> None:
    """Walk the input once, without recursion: depth, and text PostgreSQL and UTF-8 can store."""
    pending: list[tuple[Any, int, str]] = [(data, 1, "input")]
    while pending:
        value, depth, where = pending.pop()
        if depth > MAX_INPUT_DEPTH:
            shown = where if len(where) <= 60 else where[:60] + "..."
            raise InvalidStart(
                f"a run's input is nested more than {MAX_INPUT_DEPTH} levels deep (at {shown}) or "
                "refers to itself; flatten it"
            )
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        for name, item in items:
            if isinstance(name, str) and isinstance(value, Mapping):
                _check_text(name, f"field name {name!r} in {where}")
            if isinstance(item, str):
                _check_text(item, f"{where}[{name!r}]")
            elif isinstance(item, float) and not math.isfinite(item):
                raise InvalidStart(
                    f"{where}[{name!r}] is {item}, which JSON cannot hold; send None or a string instead"
                )
            elif isinstance(item, (Mapping, list, tuple)):
                pending.append((item, depth + 1, f"{where}[{name!r}]"))


def _check_text(text: str, where: str) -> None:
    if "\x00" in text:
        raise InvalidStart(f"{where} contains a NUL character (\\x00), which cannot be stored; remove it")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidStart(
            f"{where} has a lone surrogate at character {exc.start}, which is not valid UTF-8; "
            "decode the text it came from with errors='replace', or drop that character"
        ) from exc


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values (and PostgreSQL's jsonb) are: ``true`` is not ``1``, ``1`` is ``1.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


MAX_TAGS = 20  # tags on one run
MAX_TAG_NAME = 64  # characters of a tag's name
MAX_TAG_VALUE = 200  # characters of a tag's value


def check_tags(tags: Any) -> dict[str, str] | None:
    """A run's tags as a dict of str to str (None for none), or InvalidStart: at most
    ``MAX_TAGS``, names of 1 to ``MAX_TAG_NAME`` characters, values of up to ``MAX_TAG_VALUE``."""
    if tags is None:
        return None
    if not isinstance(tags, Mapping):
        raise InvalidStart(f"tags must be a mapping of str to str, not {type(tags).__name__}")
    if len(tags) > MAX_TAGS:
        raise InvalidStart(f"a run takes at most {MAX_TAGS} tags, not {len(tags)}")
    for name, value in tags.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TAG_NAME:
            raise InvalidStart(f"a tag's name is a str of 1 to {MAX_TAG_NAME} characters, not {name!r}")
        if not isinstance(value, str) or len(value) > MAX_TAG_VALUE:
            raise InvalidStart(
                f"tag {name!r}: a value is a str of up to {MAX_TAG_VALUE} characters, not {value!r:.80}"
            )
        if "\x00" in name + value:
            raise InvalidStart(f"tag {name!r}: a NUL character cannot be stored")
    return dict(tags) or None
