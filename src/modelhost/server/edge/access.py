"""Who may reach the app: the local access guard, the API key, CORS, and the edge they form.

The listener binds loopback by default, but a loopback port is still reachable from a browser:
a page on another site can send requests to it, and DNS rebinding can make an attacker's
hostname resolve to 127.0.0.1. The guard refuses both with `403 {error:{message, type:
"forbidden", code}}`, checked in this order:

- `Host` must be a loopback name or address, `host.docker.internal`, or the bound address; a
  wildcard bind (0.0.0.0, ::) also accepts any IP literal and this machine's name (or
  `<name>.local`). Otherwise `invalid_host`.
- `Origin`, when present, must be `http(s)://<Host>` or a `--cors-origin`. Otherwise
  `cross_origin`.
- `Sec-Fetch-Site`, when present, must be `same-origin` or `none` (or come with an allowed
  `--cors-origin`). Otherwise `cross_site`.
- An operator action (anything but GET under `/api/`: load, unload, pin, jobs, Ollama's pull;
  a surface's other routes there, Ollama's chat and the rest, are none) must be same-origin in
  both: a `--cors-origin` opens the API to a page, not the server's controls.

Clients that send none of these headers (curl, the SDKs) pass. With `--api-key`, every route but
`/health` and the console's page and files (they hold no data: observability/console.py) also needs
`Authorization: Bearer KEY` or `x-api-key: KEY` (the Anthropic SDK's header), compared in
constant time; a miss is a 401 in the calling protocol's error shape.

The edge, outermost first: request id and log (`request_context.ObservedRequests`), the guard,
CORS, the API key, body limits (`limits.BodyLimits`), then the app itself (model leasing
included), so nothing unauthorised or oversized ever leases or loads a model. A worker
process's app keeps only the request id and log: only its parent reaches its Unix socket (0600,
in a 0700 directory), and the parent already checked the request (a Responses turn it forwards
may be longer than the client's body: it carries the stored turn it continues).
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from modelhost.server.edge.limits import BodyLimits
from modelhost.server.edge.request_context import ObservedRequests, RequestObserver
from modelhost.server.observability.console import is_console_file
from modelhost.server.observability.prometheus import Metrics
from modelhost.server.surfaces import Surfaces

WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
LOOPBACK_NAMES = frozenset({"localhost", "host.docker.internal"})
SAME_SITE_FETCHES = frozenset({"same-origin", "none"})
OPEN_PATHS = frozenset({"/health"})
OPERATOR_PREFIX = "/api/"  # /api/models/..., /api/hub/serve, /api/jobs


def edge(
    app: ASGIApp,
    settings: Any,
    metrics: Metrics | None,
    surfaces: Surfaces,
    observers: Sequence[RequestObserver] = (),
) -> ASGIApp:
    """`app` wrapped in the edge layers `settings` asks for (see the module docstring); their
    refusals take the error shape of the surface a path belongs to; `observers` are told of
    each request."""
    if settings.owner == "worker":  # a worker's socket is reachable by its parent only
        return ObservedRequests(app, metrics, observers)
    wrapped: ASGIApp = BodyLimits(
        app,
        surfaces,
        max_body_bytes=settings.max_body_bytes,
        max_json_depth=settings.max_json_depth,
        max_json_values=settings.max_json_values,
    )
    if settings.api_key:
        wrapped = ApiKeyCheck(
            wrapped, surfaces, api_key=settings.api_key, open_console=settings.console
        )
    if settings.cors_origins:
        wrapped = CORSMiddleware(
            wrapped,
            allow_origins=list(settings.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "warning", "x-modelhost-tools-not-offered"],
        )
    wrapped = LocalAccessGuard(
        wrapped,
        bind_host=settings.host,
        allowed_origins=settings.cors_origins,
        surface_paths=frozenset(route.path for route in surfaces.routes() if not route.operator),
    )
    return ObservedRequests(wrapped, metrics, observers)


# ---------------------------------------------------------------------------------------------
# The local access guard


def forbidden(code: str, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "forbidden", "code": code}}, status_code=403
    )


def host_name(host: str) -> str:
    """The name or address part of a Host header value, lowercased (`[::1]:8080` → `::1`)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def machine_names() -> frozenset[str]:
    name = socket.gethostname().lower().rstrip(".")
    short = name.partition(".")[0]
    return frozenset({name, short, f"{short}.local"})


def host_allowed(host: str, bound: Iterable[str], *, wildcard: bool) -> bool:
    name = host_name(host)
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    address = _ip(name)
    if address is not None and (address.is_loopback or wildcard):
        return True
    if name in {host_name(b) for b in bound if b}:
        return True
    return wildcard and name in machine_names()


def access_problem(
    headers: dict[str, str],
    *,
    bound: Iterable[str],
    wildcard: bool,
    allowed_origins: Sequence[str] = (),
) -> tuple[str, str] | None:
    """(code, message) when a request must be refused, else None."""
    host = headers.get("host")
    if host is not None and not host_allowed(host, bound, wildcard=wildcard):
        return "invalid_host", f"host '{host}' is not allowed to reach this local server"
    origin = headers.get("origin")
    origin_allowed = origin is not None and ("*" in allowed_origins or origin in allowed_origins)
    if origin is not None and not origin_allowed:
        here = (host or "").lower()
        if host is None or origin.lower() not in (f"http://{here}", f"https://{here}"):
            return "cross_origin", f"origin '{origin}' is not allowed to reach this local server"
    fetch_site = headers.get("sec-fetch-site")
    cross = fetch_site is not None and fetch_site.lower() not in SAME_SITE_FETCHES
    if cross and not origin_allowed:
        return "cross_site", f"{fetch_site} requests are not allowed to reach this local server"
    return None


class LocalAccessGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        bind_host: str,
        allowed_origins: Sequence[str] = (),
        surface_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.surface_paths = surface_paths  # a protocol's own /api/ routes (Ollama's) are no
        # operator actions: a --cors-origin opens them as it opens /v1/
        self.bind_host = bind_host
        self.wildcard = bind_host in WILDCARD_BINDS
        self.allowed_origins = tuple(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {
            key.decode("latin-1").lower(): value.decode("latin-1")
            for key, value in scope.get("headers", [])
            if key.lower() in (b"host", b"origin", b"sec-fetch-site")
        }
        server = scope.get("server") or ("",)
        bound = (self.bind_host, str(server[0]))  # the address this connection came in on
        # Operator actions (load, unload, pin, jobs) come from this server's own page or from
        # clients without a browser's headers: a --cors-origin does not reach them.
        path = scope["path"]
        operator = (
            path.startswith(OPERATOR_PREFIX)
            and scope.get("method") != "GET"
            and path not in self.surface_paths
        )
        allowed_origins = () if operator else self.allowed_origins
        problem = access_problem(
            headers, bound=bound, wildcard=self.wildcard, allowed_origins=allowed_origins
        )
        if problem is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http":
            await forbidden(*problem)(scope, receive, send)
        else:
            await send({"type": "websocket.close", "code": 1008})


# ---------------------------------------------------------------------------------------------
# The API key


def presented_keys(scope: Scope) -> tuple[bytes, bytes]:
    """(the Bearer token, the x-api-key value); empty when absent."""
    bearer = x_api_key = b""
    for key, value in scope.get("headers", []):
        name = key.lower()
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                bearer = token.strip()
        elif name == b"x-api-key":
            x_api_key = value.strip()
    return bearer, x_api_key


class ApiKeyCheck:
    def __init__(
        self,
        app: ASGIApp,
        surfaces: Surfaces,
        *,
        api_key: str,
        open_paths: frozenset[str] = OPEN_PATHS,
        open_console: bool = False,
    ) -> None:
        self.app = app
        self.surfaces = surfaces
        self.api_key = api_key.encode()
        self.open_paths = open_paths
        self.open_console = open_console  # the console's page and files hold no data

    def authorized(self, scope: Scope) -> bool:
        bearer, x_api_key = presented_keys(scope)
        # Both compared, each in constant time: the answer never says which one was tried.
        by_bearer = hmac.compare_digest(bearer, self.api_key)
        by_header = hmac.compare_digest(x_api_key, self.api_key)
        return by_bearer or by_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        if self.open_console and is_console_file(scope):
            await self.app(scope, receive, send)
            return
        if any(presented_keys(scope)):
            code, message = "invalid_api_key", "invalid API key"
        else:
            code = "missing_api_key"
            message = "an API key is required: send `Authorization: Bearer <key>` or `x-api-key`"
        body = {"message": message, "type": "invalid_request_error", "code": code}
        response = self.surfaces.errors_for(scope["path"]).response(401, body)
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)
