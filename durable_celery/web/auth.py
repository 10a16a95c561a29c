"""Who may act: a bearer token for scripts, a session cookie plus a CSRF field for the browser.

Without a token the dashboard is read-only. With one, a POST needs either the header
``Authorization: Bearer <token>`` or, from a page, the session cookie ``/login`` sets together
with the form's hidden ``csrf`` field (an attacker's page can send the cookie but cannot read
the field). Both values are HMACs of the token, so the token itself never reaches a page.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from ..errors import DurableError

SESSION_COOKIE = "durable_web_session"


class ReadOnly(DurableError):
    """The dashboard was started without a token: it shows, it does not act."""


class Unauthorized(DurableError):
    """The request lacks the token (or the page's session and CSRF field)."""


def derived(token: str, purpose: str) -> str:
    """An HMAC of ``purpose`` keyed by the token: the session cookie and the CSRF field."""
    return hmac.new(token.encode(), purpose.encode(), hashlib.sha256).hexdigest()


def same(a: str | None, b: str) -> bool:
    """Constant-time equality of a given value and the expected one."""
    return a is not None and hmac.compare_digest(a.encode(), b.encode())


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer`` header, if any."""
    value = headers.get("authorization") or ""
    scheme, _, given = value.partition(" ")
    return given.strip() if scheme.lower() == "bearer" and given.strip() else None


def logged_in(token: str | None, cookies: Mapping[str, str]) -> bool:
    """Whether the browser holds this token's session cookie."""
    return token is not None and same(cookies.get(SESSION_COOKIE), derived(token, "session"))


def check_bearer(token: str | None, headers: Mapping[str, str]) -> None:
    """Let an API call act only with the right bearer token."""
    if token is None:
        raise ReadOnly("the dashboard is read-only: start it with --token (or DURABLE_WEB_TOKEN) to act")
    if not same(bearer(headers), token):
        raise Unauthorized("this needs the header 'Authorization: Bearer <token>'")


def check_form(token: str | None, headers: Mapping[str, str], cookies: Mapping[str, str], form: Any) -> None:
    """Let a page's form act: a bearer token, or the session cookie with the CSRF field, sent
    from this dashboard's own origin."""
    if token is None:
        raise ReadOnly("the dashboard is read-only: start it with --token (or DURABLE_WEB_TOKEN) to act")
    if same(bearer(headers), token):
        return
    origin = headers.get("origin")
    if origin and origin != "null" and urlsplit(origin).netloc != headers.get("host"):
        raise Unauthorized(f"a form posted from another site ({origin}) is refused")
    csrf = form.get("csrf") if form is not None else None
    if not logged_in(token, cookies) or not same(
        csrf if isinstance(csrf, str) else None, derived(token, "csrf")
    ):
        raise Unauthorized("log in with the dashboard's token first (the form's session has expired)")


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve a non-loopback address without a token."""
    if token:
        return
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise DurableError(
            f"refusing to serve the dashboard on {host} without a token: anyone who can reach it could "
            "act on runs; give --token (or DURABLE_WEB_TOKEN), or bind 127.0.0.1"
        )
