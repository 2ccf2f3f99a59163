"""Tools a client declared that this server cannot run: never offered to the model, never dropped
in silence.

Hosted tools (a web search, a code sandbox, an image generator) run on the vendor's servers in
the real APIs; here nothing would run them, so a model that called one would wait forever. A
request that declares them is still answered (agents declare them on every turn, whatever the
backend): the response's `x-modelhost-tools-not-offered` header and the request's log line name
them. A request that *forces* one (`tool_choice`) is a 400 naming it: the answer it asks for
cannot exist.
"""

from __future__ import annotations

from collections.abc import Iterable

from modelhost.inference.contracts import InvalidRequest

HEADER = "x-modelhost-tools-not-offered"
LOG_FIELD = "tools_not_offered"


def headers(kinds: Iterable[str]) -> dict[str, str]:
    """The response header naming `kinds` (each once, in order); none when there are none."""
    named = list(dict.fromkeys(kinds))
    return {HEADER: ", ".join(named)} if named else {}


def forced_refusal(kind: str, param: str = "tool_choice") -> InvalidRequest:
    """The 400 for a `tool_choice` that forces a tool of `kind`, which nothing here runs."""
    message = (
        f"tool_choice forces the {kind} tool, which this server cannot run "
        f"(it is not offered to the model)"
    )
    return InvalidRequest(message, param=param)
