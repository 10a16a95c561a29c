"""The dashboard as a Starlette app: ``create_app(durable, token=None)``; pages and JSON API."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import DatabaseUnavailable, DurableError, RunNotFound, ScheduleNotFound
from ..store import dashboard_rows
from . import actions, auth, data

if TYPE_CHECKING:
    from ..app import Durable

HERE = Path(__file__).parent
HEADERS = {
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; form-action 'self'",
    "Cache-Control": "no-store",
}


class PageNotFound(DurableError):
    """No page or API endpoint at this path."""


def error_status(exc: Exception) -> int:
    """The HTTP status of an error: 404 unknown, 400 bad argument, 401/403 auth, 409 refused."""
    if isinstance(exc, (RunNotFound, ScheduleNotFound, PageNotFound)):
        return 404
    if isinstance(exc, auth.Unauthorized):
        return 401
    if isinstance(exc, auth.ReadOnly):
        return 403
    if isinstance(exc, DatabaseUnavailable):
        return 503
    if isinstance(exc, ValueError):
        return 400
    return 409


def pretty(value: Any) -> str:
    """JSON text of a value for a <pre> block (escaped by the template like any text)."""
    return json.dumps(data.jsonable(value), indent=2, sort_keys=True, ensure_ascii=False)


def short_json(value: Any, most: int = 80) -> str:
    """One-line JSON of a value, cut at ``most`` characters."""
    text = json.dumps(data.jsonable(value), ensure_ascii=False, sort_keys=True)
    return text if len(text) <= most else text[: most - 1] + "…"


def age(value: datetime, now: datetime | None = None) -> str:
    """How long ago (or how far ahead) a time is: ``3 min ago``, ``in 20 s``, ``now``."""
    seconds = ((now or datetime.now(timezone.utc)) - value).total_seconds()
    size = abs(seconds)
    if size < 1:
        return "now"
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if size >= length:
            amount = f"{int(size // length)} {unit}"
            break
    else:
        amount = f"{int(size)} s"
    return f"{amount} ago" if seconds > 0 else f"in {amount}"


def when(value: Any) -> Markup:
    """A time as ``YYYY-MM-DD HH:MM:SS UTC`` with its age (``3 min ago``, ``in 20 s``), or ``-``."""
    if value is None:
        return Markup("-")
    value = value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
    value = value.astimezone(timezone.utc)
    return Markup('<time datetime="{}">{} UTC</time> <span class="age">{}</span>').format(
        value.isoformat(), value.strftime("%Y-%m-%d %H:%M:%S"), age(value)
    )


def seconds(value: Any) -> str:
    """A number of seconds for people: ``90 s``, ``10 min``, ``2 h``; ``-`` for none."""
    if value is None:
        return "-"
    value = float(value)
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if value >= length and value % length == 0:
            return f"{int(value // length)} {unit}"
    return f"{value:g} s"


def make_environment() -> Environment:
    """The Jinja2 environment: package templates, every value escaped."""
    env = Environment(
        loader=PackageLoader("durable_celery.web", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    env.filters.update(
        pretty=pretty, short_json=short_json, when=when, seconds=seconds, q=lambda v: quote(str(v), safe="")
    )
    env.globals.update(statuses=dashboard_rows.STATUSES, urlencode=urlencode, unfinished=data.unfinished)
    return env


class Dashboard:
    """Routes and rendering around one ``Durable``."""

    def __init__(self, durable: Durable, token: str | None) -> None:
        self.durable = durable  # actions, and reads followed by one
        self.reader = durable.reader  # the pages' reads: the read replica's, when there is one
        self.token = token or None
        self.env = make_environment()

    # -- rendering ---------------------------------------------------------------------------

    def render(self, request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        """A page from its template with the common context (read-only, login, CSRF field)."""
        logged = auth.logged_in(self.token, request.cookies)
        html = self.env.get_template(template).render(
            request_path=request.url.path,
            read_only=self.token is None,
            logged_in=logged,
            csrf=auth.derived(self.token, "csrf") if logged and self.token else "",
            message=request.query_params.get("msg"),
            refresh=request.query_params.get("refresh"),
            **context,
        )
        return HTMLResponse(html, status_code=status, headers=HEADERS)

    def page(
        self, template: str, build: Callable[[Request], Any]
    ) -> Callable[[Request], Awaitable[Response]]:
        """An HTML page whose context ``build`` makes in a worker thread."""

        async def endpoint(request: Request) -> Response:
            try:
                context = await run_in_threadpool(build, request)
            except DurableError as exc:
                return self.error_page(request, exc)
            if isinstance(context, Response):
                return context
            return self.render(request, template, **context)

        return endpoint

    def error_page(self, request: Request, exc: Exception) -> HTMLResponse:
        """The error page: the error's class and message, escaped."""
        return self.render(
            request, "error.html", status=error_status(exc), error=type(exc).__name__, detail=str(exc)
        )

    def api(self, build: Callable[[Request], Any]) -> Callable[[Request], Awaitable[Response]]:
        """A JSON GET endpoint; errors as ``{"error": class, "message": text}``."""

        async def endpoint(request: Request) -> Response:
            try:
                return json_response(await run_in_threadpool(build, request))
            except DurableError as exc:
                return json_error(exc)

        return endpoint

    # -- pages -------------------------------------------------------------------------------

    def overview(self, request: Request) -> dict[str, Any]:
        """The overview page's data."""
        return data.overview(self.reader)

    def runs(self, request: Request) -> Any:
        """A page of runs, or a redirect when the search names a run."""
        found = data.runs_page(self.reader, dict(request.query_params))
        if "run_id" in found:
            if found["run_id"] is None:
                raise RunNotFound(request.query_params.get("q", "").strip())
            return RedirectResponse(f"/runs/{quote(found['run_id'])}", status_code=303)
        return found

    def run(self, request: Request) -> dict[str, Any]:
        """One run with its steps, events, family, activity and key view."""
        return data.run_detail(self.reader, request.path_params["run_id"])

    def confirm_cancel(self, request: Request) -> dict[str, Any]:
        """The page that asks before a cancel: the run, its step and children left to cancel."""
        run_id = request.path_params["run_id"]
        run = self.durable.get_run(run_id)
        children = [c for c in self.durable.list_children(run_id, limit=200) if data.unfinished(c.status)]
        return {"run": run, "children": children}

    def keys(self, request: Request) -> dict[str, Any]:
        """A page of key rows by workflow and prefix (``after``: a page's ``next``), and the keys
        re-added most."""
        params = request.query_params
        limit = data.check_limit(params.get("limit"), 200, 1000)
        return data.keys_data(
            self.reader, params.get("workflow"), params.get("prefix"), limit, params.get("after")
        )

    def flow(self, request: Request) -> dict[str, Any]:
        """Flow control: each limit's use per key, by workflow."""
        params = request.query_params
        keys = data.check_limit(params.get("limit"), 50, 500)
        return data.flow_data(self.reader, params.get("workflow"), keys)

    def workflow(self, request: Request) -> dict[str, Any]:
        """One workflow: definition, recent runs, keys."""
        return data.workflow_data(self.reader, request.path_params["name"])

    def queues(self, request: Request) -> dict[str, Any]:
        """Queues with counts and consumers; nodes; worker trouble."""
        return data.queues_data(self.reader)

    def schedules(self, request: Request) -> dict[str, Any]:
        """Every schedule with its state."""
        return data.schedules_data(self.reader)

    def settings(self, request: Request) -> dict[str, Any]:
        """Effective settings, schema state, prune rules."""
        return data.settings_data(self.reader)

    # -- API reads ---------------------------------------------------------------------------

    def api_runs(self, request: Request) -> Any:
        """``GET /api/runs``: runs by workflow, status, key, limit; ``after`` the ``next`` of a page."""
        params = dict(request.query_params)
        params.setdefault("limit", "50")
        found = data.runs_page(self.reader, params)
        return {"runs": found.get("runs", []), "more": found.get("more", False), "next": found.get("next")}

    def api_run(self, request: Request) -> Any:
        """``GET /api/runs/<id>``: run, steps, events, children, activity, key view."""
        detail = data.run_detail(self.reader, request.path_params["run_id"])
        return {
            "run": detail["run"],
            "steps": detail["steps"],
            "events": detail["events"],
            "waiting_for": detail["waiting_for"],
            "children": detail["children"],
            "activity": detail["activity"],
            "key": detail["key"],
            "state": detail["state"],
        }

    def api_keys(self, request: Request) -> Any:
        """``GET /api/keys``: key rows by workflow and prefix; ``after`` the ``next`` of a page."""
        return self.keys(request)

    def api_queues(self, request: Request) -> Any:
        """``GET /api/queues``: queues and nodes."""
        return data.queues_data(self.reader)

    def api_schedules(self, request: Request) -> Any:
        """``GET /api/schedules``: every schedule."""
        found = data.schedules_data(self.reader)
        if found["error"]:
            raise DurableError(found["error"])
        return {"schedules": found["schedules"]}

    # -- login -------------------------------------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        """The form that takes the token."""
        return self.render(request, "login.html", next=safe_next(request.query_params.get("next")))

    async def login(self, request: Request) -> Response:
        """Check the token and set the session cookie."""
        form = await request.form()
        given = form.get("token")
        target = safe_next(form.get("next"))
        if self.token is None or not auth.same(given if isinstance(given, str) else None, self.token):
            return self.render(request, "login.html", status=401, next=target, failed=True)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            auth.SESSION_COOKIE,
            auth.derived(self.token, "session"),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(self, request: Request) -> Response:
        """Drop the session cookie."""
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(auth.SESSION_COOKIE)
        return response

    # -- actions -----------------------------------------------------------------------------

    async def form_action(self, request: Request) -> Response:
        """A page's action button: check the session and CSRF field, act, go back with a note."""
        form = await request.form()
        try:
            auth.check_form(self.token, request.headers, request.cookies, form)
            target, note = await run_in_threadpool(
                actions.perform,
                self.durable,
                request.path_params,
                action_of(request),
                dict(form),
                "dashboard",
                client_address(request),
            )
        except DurableError as exc:
            return self.error_page(request, exc)
        return RedirectResponse(f"{target}?{urlencode({'msg': note})}", status_code=303)

    async def api_action(self, request: Request) -> Response:
        """A script's action: the bearer token, a JSON body (for events and inputs)."""
        try:
            auth.check_bearer(self.token, request.headers)
            body = await json_body(request)
            target, note = await run_in_threadpool(
                actions.perform,
                self.durable,
                request.path_params,
                action_of(request),
                body,
                "api",
                client_address(request),
            )
        except DurableError as exc:
            return json_error(exc)
        return json_response({"ok": True, "result": note, "location": target})


async def json_body(request: Request) -> dict[str, Any]:
    """The JSON object a POST carries ({} when empty)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise actions.BadRequest("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise actions.BadRequest("the request body must be a JSON object")
    return body


def client_address(request: Request) -> str:
    """Where a request came from: the client's address as the server sees it."""
    return request.client.host if request.client is not None else "unknown"


def action_of(request: Request) -> str:
    """The action a POST names: the last part of its path."""
    return str(request.scope["path"]).rstrip("/").rsplit("/", 1)[-1]


def safe_next(value: Any) -> str:
    """A local path to go back to after login (never another site)."""
    if isinstance(value, str) and value.startswith("/") and not value.startswith("//"):
        return value
    return "/"


def json_response(value: Any, status: int = 200) -> JSONResponse:
    """JSON of page data, with the dashboard's headers."""
    return JSONResponse(data.jsonable(value), status_code=status, headers={"Cache-Control": "no-store"})


def json_error(exc: Exception) -> JSONResponse:
    """An error as JSON: its class name and message."""
    return json_response({"error": type(exc).__name__, "message": str(exc)}, error_status(exc))


def create_app(durable: Durable, token: str | None = None) -> Starlette:
    """The dashboard for ``durable``; with ``token`` its actions work, without it it is read-only."""
    d = Dashboard(durable, token)
    routes = [
        Route("/", d.page("overview.html", d.overview)),
        Route("/runs", d.page("runs.html", d.runs)),
        Route("/runs/{run_id}", d.page("run.html", d.run)),
        Route("/runs/{run_id}/cancel", d.page("confirm_cancel.html", d.confirm_cancel), methods=["GET"]),
        Route("/keys", d.page("keys.html", d.keys)),
        Route("/flow", d.page("flow.html", d.flow)),
        Route("/workflows/{name:path}", d.page("workflow.html", d.workflow)),
        Route("/queues", d.page("queues.html", d.queues)),
        Route("/schedules", d.page("schedules.html", d.schedules)),
        Route("/settings", d.page("settings.html", d.settings)),
        Route("/login", d.login_page, methods=["GET"]),
        Route("/login", d.login, methods=["POST"]),
        Route("/logout", d.logout, methods=["POST"]),
        Route("/api/runs", d.api(d.api_runs)),
        Route("/api/runs/{run_id}", d.api(d.api_run)),
        Route("/api/keys", d.api(d.api_keys)),
        Route("/api/flow", d.api(d.flow)),
        Route("/api/queues", d.api(d.api_queues)),
        Route("/api/schedules", d.api(d.api_schedules)),
        Route("/api/overview", d.api(d.overview)),
        Route("/api/settings", d.api(d.settings)),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    for pattern in actions.PATTERNS:
        routes.append(Route(pattern, d.form_action, methods=["POST"]))
        routes.append(Route("/api" + pattern, d.api_action, methods=["POST"]))
    app = Starlette(routes=routes)

    async def not_found(request: Request, exc: Exception) -> Response:
        missing = PageNotFound(f"no page at {request.url.path}")
        if request.url.path.startswith("/api/"):
            return json_error(missing)
        return d.error_page(request, missing)

    app.add_exception_handler(404, not_found)
    app.state.dashboard = d
    return app
