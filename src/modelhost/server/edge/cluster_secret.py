"""The per-cluster secret: what every request to a node's worker carries, and the worker's check.

A worker in a cluster listens on its node's address, where other machines can reach it. Each
request the front sends it carries `x-modelhost-cluster-secret`; the worker compares it in
constant time and refuses a request without it (401) on that listener. Its private Unix socket
(0600, reached by the node's own actor for health checks and drains) needs none. The worker
reads the secret from its environment, never from its command line (which `ps` shows).

The secret is the cluster's own: the first front to join generates one and keeps it in the
cluster's key-value store (`cluster/membership.py`), or an operator gives one with
`--cluster-token-file` (a file only its owner can read: mode 0600).
"""

from __future__ import annotations

import hmac
import os
import stat
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

SECRET_HEADER = "x-modelhost-cluster-secret"
SECRET_ENV = "MODELHOST_CLUSTER_SECRET"


class ClusterSecretGuard:
    """Refuse every request that came over TCP without the cluster's secret."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        if not secret:
            raise ValueError("a cluster worker needs a secret")
        self.app = app
        self._secret = secret.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        over_tcp = isinstance(server, tuple | list) and server[1] is not None
        if scope["type"] in ("http", "websocket") and over_tcp:
            given = dict(scope.get("headers", [])).get(SECRET_HEADER.encode(), b"")
            if not hmac.compare_digest(given, self._secret):
                body = {
                    "message": "this worker serves its cluster's front only",
                    "type": "unauthorized",
                    "code": "cluster_secret_required",
                }
                await JSONResponse({"error": body}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def read_token_file(path: str | Path) -> str:
    """The secret in `path`, which must be readable by its owner only."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise SystemExit(f"modelhost serve: cannot read --cluster-token-file: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SystemExit(
            f"modelhost serve: --cluster-token-file {path} is readable by others; chmod 600 it"
        )
    if len(text) < 16:
        raise SystemExit(f"modelhost serve: --cluster-token-file {path} holds under 16 characters")
    return text


def secret_from_env() -> str | None:
    return os.environ.get(SECRET_ENV) or None
