"""Reading OpenAI request fields, with the reference's 400 messages.

A field that is absent or `null` is unset. A field of the wrong type is
`<name> must be of type <type>`; out of range is `<name> must be at least/at most <bound>`.
Fields this server does not know are ignored, as OpenAI clients send many.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from modelhost.inference.contracts import GrammarSpec, InvalidRequest, SamplingRequest
from modelhost.inference.grammars.tool_choice import forced_call

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", dict: "dict", list: "list"}


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and not _is(value, kind):
        raise InvalidRequest(f"{name} must be of type {_TYPE_NAMES[kind]}", param=name)
    return value


def number(
    body: dict[str, Any],
    name: str,
    kind: type = float,
    *,
    at_least: float | None = None,
    at_most: float | None = None,
    above: float | None = None,
) -> Any:
    value = field(body, name, kind)
    if value is None:
        return None
    if at_least is not None and value < at_least:
        raise InvalidRequest(f"{name} must be at least {at_least:g}", param=name)
    if at_most is not None and value > at_most:
        raise InvalidRequest(f"{name} must be at most {at_most:g}", param=name)
    if above is not None and value <= above:
        raise InvalidRequest(f"{name} must be greater than {above:g}", param=name)
    return value


def sampling(body: dict[str, Any]) -> SamplingRequest:
    top_k = number(body, "top_k", int, at_least=-1)
    return SamplingRequest(
        temperature=number(body, "temperature", at_least=0),
        top_p=number(body, "top_p", at_least=0, at_most=1),
        top_k=None if top_k == -1 else top_k,
        min_p=number(body, "min_p", at_least=0, at_most=1),
        repetition_penalty=number(body, "repetition_penalty", above=0),
        presence_penalty=number(body, "presence_penalty", at_least=-2, at_most=2),
        frequency_penalty=number(body, "frequency_penalty", at_least=-2, at_most=2),
        logit_bias=logit_bias(body),
        seed=field(body, "seed", int),
        speculate=field(body, "speculate", bool),
    )


def logit_bias(body: dict[str, Any]) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    message = "logit_bias must be a dict of int to float"
    if not isinstance(value, dict):
        raise InvalidRequest(message, param="logit_bias")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(message, param="logit_bias") from None
        if not _is(amount, float):
            raise InvalidRequest(message, param="logit_bias")
        bias[token_id] = float(amount)
    return bias


def stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(item for item in value if item)
    raise InvalidRequest("stop must be a string or a list of strings", param="stop")


def max_tokens(body: dict[str, Any]) -> int | None:
    """`max_completion_tokens` wins over `max_tokens`; None: the server's default."""
    newer = number(body, "max_completion_tokens", int, at_least=1)
    older = number(body, "max_tokens", int, at_least=1)
    return newer if newer is not None else older


def max_tokens_field(body: dict[str, Any]) -> str:
    """The budget's field as the client named it, for a 400 about the budget."""
    return (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )


@dataclass(frozen=True, slots=True)
class StreamOptions:
    stream: bool
    include_usage: bool


def stream_options(body: dict[str, Any]) -> StreamOptions:
    streaming = bool(field(body, "stream", bool))
    options = field(body, "stream_options", dict) or {}
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise InvalidRequest(
            "stream_options.include_usage must be of type bool", param="stream_options"
        )
    return StreamOptions(streaming, bool(include))


def choices(body: dict[str, Any]) -> int:
    value = number(body, "n", int, at_least=1)
    return 1 if value is None else value


def structured_output(body: dict[str, Any]) -> tuple[GrammarSpec | None, str | None]:
    """The grammar a structured-output field asks the stage to enforce, and the instruction that
    describes that output (folded into a chat prompt only when the grammar cannot be enforced,
    with a Warning); (None, None) when no such field is set.

    Precedence: guided_grammar > json_schema > json_object > structured_outputs >
    guided_regex > guided_choice.
    """
    source = field(body, "guided_grammar", str)
    if source:
        grammar = GrammarSpec("grammar", source, field="guided_grammar")
        return grammar, f"Respond following this grammar:\n{source}"
    response_format = field(body, "response_format", dict)
    if response_format is not None:
        kind = response_format.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise InvalidRequest(
                "response_format.type must be one of 'text', 'json_object', 'json_schema'",
                param="response_format",
            )
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema", spec) if isinstance(spec, dict) else spec
            text = _schema_text(schema)
            grammar = GrammarSpec("json_schema", text, field="response_format.json_schema")
            return grammar, json_schema_instruction(json.dumps(schema))
        if kind == "json_object":
            return GrammarSpec("json_object", field="response_format"), JSON_OBJECT_INSTRUCTION
    prefix = "guided_"
    outputs = field(body, "structured_outputs", dict)
    if outputs:
        if outputs.get("json") is not None:
            text = _schema_text(outputs["json"])
            grammar = GrammarSpec("json_schema", text, field="structured_outputs.json")
            return grammar, json_schema_instruction(text)
        body = {**body, **{f"guided_{key}": value for key, value in outputs.items()}}
        prefix = "structured_outputs."
    regex = field(body, "guided_regex", str)
    if regex:
        grammar = GrammarSpec("regex", regex, field=f"{prefix}regex")
        return grammar, f"Respond only with text that matches the regular expression {regex}"
    choice = field(body, "guided_choice", list)
    if choice:
        choices = tuple(str(item) for item in choice)
        grammar = GrammarSpec("choice", choices=choices, field=f"{prefix}choice")
        return grammar, "Respond with exactly one of: " + ", ".join(choices)
    return None, None


def json_schema_instruction(schema_text: str) -> str:
    """What a prompt asks for when a JSON schema cannot be enforced by a grammar."""
    return f"Respond only with JSON that matches this JSON schema:\n{schema_text}"


JSON_OBJECT_INSTRUCTION = "Respond only with a single valid JSON object."


def _schema_text(schema: Any) -> str:
    # A schema that is not JSON at all still goes to the compiler, which names the problem.
    return schema if isinstance(schema, str) else json.dumps(schema)


def reasoning_effort(body: dict[str, Any]) -> str | None:
    value = body.get("reasoning_effort")
    if value is not None and value not in REASONING_EFFORTS:
        allowed = ", ".join(f"'{effort}'" for effort in REASONING_EFFORTS)
        raise InvalidRequest(f"reasoning_effort must be one of {allowed}", param="reasoning_effort")
    return value


def forced_tool(
    choice: Any, tools: Sequence[dict[str, Any]] | None
) -> tuple[GrammarSpec, str] | None:
    """The grammar and instruction a forcing `tool_choice` implies: `required`, or a named
    function or custom tool in chat's nested shape or the Responses API's flat one; None for
    auto and none."""
    if not tools:
        return None
    if choice == "required":
        return forced_call(tools, None)
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom"):  # chat nests the name under its type; Responses does not
        nested = choice.get(kind)
        name = nested.get("name") if isinstance(nested, dict) else choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequest(f"tool_choice.{kind}.name must be of type str", "tool_choice")
        return forced_call(tools, name)
    return None
