"""The pure parts of the key decision, pinned exactly: what a dropped input keeps (its limits and
their boundaries), the reuse table, and what ``after_commit`` does in which order. Written
against mutants of durable_celery/core/keys.py that the behaviour tests let through."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace
from typing import Any

import pytest

from durable_celery.core.control import after_commit
from durable_celery.core.keys import (
    DROPPED_INPUT_KEPT,
    DROPPED_INPUT_PREVIEW,
    Decision,
    dropped_input,
    reuse_frees,
)
from durable_celery.errors import KeyTaken
from durable_celery.testing import RecordingOutbox, Sent

FINISHED_LIKE_FAILURE = ("failed", "cancelled", "compensated", "compensation_failed")
UNFINISHED = ("pending", "running", "waiting", "compensating")


def _input_of_json_size(size: int) -> dict[str, Any]:
    data = {"s": ""}
    data["s"] = "x" * (size - len(json.dumps(data, separators=(",", ":"))))
    assert len(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()) == size
    return data


def test_the_limits_are_the_documented_ones():
    assert (DROPPED_INPUT_KEPT, DROPPED_INPUT_PREVIEW) == (4096, 512)


def test_an_input_of_exactly_the_limit_is_kept_whole():
    data = _input_of_json_size(DROPPED_INPUT_KEPT)
    assert dropped_input(data) == {"input": data}


def test_an_input_one_byte_over_the_limit_keeps_a_digest_its_size_and_a_preview():
    data = _input_of_json_size(DROPPED_INPUT_KEPT + 1)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    assert dropped_input(data) == {
        "input_digest": hashlib.sha256(text.encode()).hexdigest(),
        "input_bytes": DROPPED_INPUT_KEPT + 1,
        "input_preview": text[:DROPPED_INPUT_PREVIEW],
    }
    assert len(dropped_input(data)["input_preview"]) == DROPPED_INPUT_PREVIEW


def test_the_size_counts_bytes_of_json_with_sorted_keys_and_no_spaces():
    data = {"b": "é" * 3000, "a": 1}  # JSON escapes each "é" as six ASCII bytes
    text = '{"a":1,"b":"' + "\\u00e9" * 3000 + '"}'
    kept = dropped_input(data)
    assert kept["input_bytes"] == len(text.encode())
    assert kept["input_digest"] == hashlib.sha256(text.encode()).hexdigest()
    assert kept["input_preview"] == text[:DROPPED_INPUT_PREVIEW]


@pytest.mark.parametrize("status", UNFINISHED)
@pytest.mark.parametrize("reuse", ["after_close", "after_failure", "never"])
def test_an_unfinished_holder_never_frees_its_key(reuse, status):
    assert reuse_frees(reuse, status) is False


@pytest.mark.parametrize("status", ["completed", *FINISHED_LIKE_FAILURE])
def test_reuse_table_for_finished_holders(status):
    assert reuse_frees("after_close", status) is True
    assert reuse_frees("after_failure", status) is (status != "completed")
    assert reuse_frees("never", status) is False


def _runtime() -> Any:
    """Stands in for the Runtime an after-commit step talks to: its outbox and its sender."""
    return SimpleNamespace(outbox=RecordingOutbox(), sender=object())


class Signal:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, sender: Any, **kwargs: Any) -> None:
        self.sent.append({"sender": sender, **kwargs})


def test_after_commit_publishes_then_signals_then_raises_the_refusal():
    rt, signal = _runtime(), Signal()
    decision = Decision(
        "r1",
        publish=[("wf", "r1", 0, 1, "k"), ("wf", "r2", 2, 3, None)],
        notices=[(signal, {"run_id": "r1"}), (signal, {"run_id": "r2"})],
        error=KeyTaken("h1"),
    )
    with pytest.raises(KeyTaken) as refused:
        after_commit(rt, decision)
    assert refused.value.holder_id == "h1"
    assert rt.outbox.sent == [Sent("wf", 0, "r1", 1, "k", soon=True), Sent("wf", 2, "r2", 3, None, soon=True)]
    assert signal.sent == [{"sender": rt.sender, "run_id": "r1"}, {"sender": rt.sender, "run_id": "r2"}]


def test_after_commit_without_a_refusal_returns():
    rt = _runtime()
    assert after_commit(rt, Decision("r1")) is None
    assert rt.outbox.sent == []
