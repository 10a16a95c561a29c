"""What the end-to-end tests share: waiting for a condition, a free port, Flower's JSON API."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest


def until(check: Callable[[], Any], timeout: float, what: str, logs: Callable[[], str] = str) -> Any:
    """Poll ``check`` until it returns something truthy and return that; fail with ``what`` (and
    ``logs()``) at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_json(url: str) -> Any:
    """The JSON a URL answers, or None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return json.loads(response.read())
    except OSError:
        return None
