"""Request limits at the edge: the body size cap (413) and JSON shape caps (400).

`BodyLimits` is an edge layer, outside model routing, so nothing parses or leases anything for
a body it refuses. A declared Content-Length over the cap is refused before a byte is read; an
undeclared (chunked) body is read up to the cap and refused as soon as it passes it, never
buffered beyond it. A body that looks like JSON is then scanned, without parsing it, for how
deep it nests and how many containers and strings it holds: a nesting bomb never reaches a
recursive parser and a body of a million empty arrays never becomes a million Python lists.
Refusals answer in the calling protocol's error shape (`surfaces.Surfaces.errors_for`).

Media parts are capped after parsing (`media.check_media_sizes`, from `http.read_json_object`).
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelhost.inference.contracts import RequestError
from modelhost.server.http import ErrorShape, replay_body

if TYPE_CHECKING:
    from modelhost.server.surfaces import Surfaces

MiB = 1024 * 1024
DEFAULT_MAX_BODY_BYTES = 32 * MiB
DEFAULT_MAX_JSON_DEPTH = 64
DEFAULT_MAX_JSON_VALUES = 200_000  # containers and strings, object keys included

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# A JSON string (possessive: no backtracking through a megabyte of base64) or a bracket.
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]++|\\.)*+"|[\[\]{}]')
_OPEN, _CLOSE = frozenset(b"[{"), frozenset(b"]}")


def too_large(limit_bytes: int) -> RequestError:
    message = f"request body is larger than the server's limit of {_size(limit_bytes)}"
    body = {"message": message, "type": "invalid_request_error", "code": "request_too_large"}
    return RequestError(413, message, body)


def json_shape_problem(raw: bytes, *, max_depth: int, max_values: int) -> str | None:
    """Why `raw` (a JSON text, unparsed) nests too deep or holds too much; None when it is fine.

    Text that does not start like a JSON object or array is left to its parser."""
    start = raw.lstrip()[:1]
    if start not in (b"{", b"["):
        return None
    depth = values = 0
    for token in _JSON_TOKEN.finditer(raw):
        first = raw[token.start()]
        if first in _CLOSE:
            depth -= 1
            continue
        values += 1
        if values > max_values:
            return f"JSON body holds more than {max_values} arrays, objects and strings"
        if first in _OPEN:
            depth += 1
            if depth > max_depth:
                return f"JSON body nests deeper than {max_depth} levels"
    return None


def _size(num_bytes: int) -> str:
    return f"{num_bytes / MiB:.1f} MiB"


class BodyLimits:
    """The edge layer that reads a request body at most up to `max_body_bytes`."""

    def __init__(
        self,
        app: ASGIApp,
        surfaces: Surfaces,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
        max_json_values: int = DEFAULT_MAX_JSON_VALUES,
    ) -> None:
        self.app = app
        self.surfaces = surfaces
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
        self.max_json_values = max_json_values

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        errors = self.surfaces.errors_for(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _refuse(scope, send, errors, too_large(self.max_body_bytes))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _refuse(scope, send, errors, too_large(self.max_body_bytes))
                return
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        problem = json_shape_problem(
            body, max_depth=self.max_json_depth, max_values=self.max_json_values
        )
        if problem is not None:
            refusal = RequestError(400, problem)
            refusal.body.update(type="invalid_request_error", code="json_too_complex")
            await _refuse(scope, send, errors, refusal)
            return
        await self.app(scope, replay_body(body, receive), send)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _refuse(scope: Scope, send: Send, errors: ErrorShape, error: RequestError) -> None:
    response = errors.response(error.status, error.body)

    async def nothing_more() -> Message:
        return {"type": "http.disconnect"}

    with contextlib.suppress(OSError):  # the client is gone already
        await response(scope, nothing_more, send)
