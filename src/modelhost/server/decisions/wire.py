"""Validation of the two decision wire shapes into one `DecisionRequest`.

OpenAI's `/v1/decisions`: `input` (a string, or messages whose text is joined) and an ordered
`questions` array of `predicate`, `choice` (`choices: [{value, description?}]`) and `score`
(`levels: [{label, description?}]`), each with an optional, unique `name`.
System One's `/v1/systemone`: `state` (a string, or JSON that is shown as JSON) and `questions`
keyed by name, of type `noul` (`criteria: {true, false}`, optional), `choice` (`criteria`: label
to description or null) and `score` (`criteria`: level descriptions, low to high).
Every refusal is an InvalidRequest whose `param` is the offending field's path.
"""

from __future__ import annotations

import json
from typing import Any

from modelhost.inference.contracts import InvalidRequest
from modelhost.inference.decision_prompt import (
    MAX_CHOICES,
    MAX_LEVELS,
    MAX_QUESTIONS,
    MIN_CHOICES,
    MIN_LEVELS,
    DecisionQuestion,
    DecisionRequest,
    Option,
)

IMAGE_REFUSAL = "model has no vision sidecar"
_MEDIA_TYPES = ("input_image", "image_url", "image", "input_audio", "audio", "input_file")


def parse_decisions(body: dict[str, Any], request_id: str) -> DecisionRequest:
    state = _openai_input(body.get("input"))
    raw = body.get("questions")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("questions must be a non-empty array", param="questions")
    _check_count(len(raw))
    questions: list[DecisionQuestion] = []
    names: set[str] = set()
    for index, item in enumerate(raw):
        where = f"questions[{index}]"
        question = _openai_question(item, where)
        if question.name is not None:
            if question.name in names:
                raise InvalidRequest(
                    f"{where}.name {question.name!r} is not unique", f"{where}.name"
                )
            names.add(question.name)
        questions.append(question)
    return DecisionRequest(request_id, state, tuple(questions))


def parse_systemone(body: dict[str, Any], request_id: str) -> DecisionRequest:
    if "state" not in body or body["state"] is None:
        raise InvalidRequest("state is required", param="state")
    state = _as_text(body["state"], "state")
    raw = body.get("questions")
    if not isinstance(raw, dict) or not raw:
        raise InvalidRequest("questions must be a non-empty object keyed by name", "questions")
    _check_count(len(raw))
    questions = tuple(_systemone_question(name, item) for name, item in raw.items())
    return DecisionRequest(request_id, state, questions)


def _check_count(count: int) -> None:
    if count > MAX_QUESTIONS:
        raise InvalidRequest(f"questions has {count} items; at most {MAX_QUESTIONS}", "questions")


# ---- OpenAI ---------------------------------------------------------------------------------


def _openai_input(value: Any) -> str:
    if isinstance(value, str) and value:
        return value
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a non-empty string or array of messages", "input")
    lines: list[str] = []
    for index, message in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be a message object", param=where)
        role = message.get("role", "user")
        text = _message_text(message.get("content"), f"{where}.content")
        lines.append(f"{role}: {text}")
    return "\n".join(lines)


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or array of content parts", param=where)
    texts: list[str] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_TYPES:
            raise InvalidRequest(IMAGE_REFUSAL, param=f"{where}[{index}]")
        if kind not in ("input_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}[{index}] must be a text part", param=f"{where}[{index}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _openai_question(item: Any, where: str) -> DecisionQuestion:
    if not isinstance(item, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = item.get("type")
    name = item.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest(f"{where}.name must be a string", param=f"{where}.name")
    instructions = _instructions(item.get("instructions"), f"{where}.instructions")
    options: tuple[Option, ...]
    if kind == "predicate":
        options = (Option("true"), Option("false"))
        return DecisionQuestion("binary", name, instructions, options, where)
    if kind == "choice":
        options = _openai_options(
            item.get("choices"), f"{where}.choices", "value", MIN_CHOICES, MAX_CHOICES
        )
        return DecisionQuestion("choice", name, instructions, options, f"{where}.choices")
    if kind == "score":
        options = _openai_options(
            item.get("levels"), f"{where}.levels", "label", MIN_LEVELS, MAX_LEVELS
        )
        return DecisionQuestion("score", name, instructions, options, f"{where}.levels")
    raise InvalidRequest(
        f"{where}.type must be one of 'predicate', 'choice', 'score'", param=f"{where}.type"
    )


def _openai_options(value: Any, where: str, key: str, low: int, high: int) -> tuple[Option, ...]:
    if not isinstance(value, list):
        raise InvalidRequest(f"{where} must be an array", param=where)
    _check_range(len(value), where, low, high)
    options: list[Option] = []
    for index, item in enumerate(value):
        at = f"{where}[{index}]"
        if not isinstance(item, dict) or not isinstance(item.get(key), str) or not item[key]:
            raise InvalidRequest(f"{at}.{key} must be a non-empty string", param=f"{at}.{key}")
        description = item.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest(f"{at}.description must be a string", param=f"{at}.description")
        options.append(Option(item[key], description))
    _check_unique(options, where)
    return tuple(options)


# ---- System One -----------------------------------------------------------------------------


def _systemone_question(name: str, item: Any) -> DecisionQuestion:
    where = f"questions.{name}"
    if not isinstance(item, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = item.get("type")
    instructions = _instructions(item.get("instructions"), f"{where}.instructions")
    criteria = item.get("criteria")
    at = f"{where}.criteria"
    options: tuple[Option, ...]
    if kind == "noul":
        if criteria is None:
            criteria = {}
        if not isinstance(criteria, dict) or set(criteria) - {"true", "false"}:
            raise InvalidRequest(f"{at} must be an object with 'true' and 'false'", param=at)
        true, false = (_description(criteria.get(k), f"{at}.{k}") for k in ("true", "false"))
        options = (Option("true", true), Option("false", false))
        return DecisionQuestion("binary", name, instructions, options, where)
    if kind == "choice":
        if not isinstance(criteria, dict):
            raise InvalidRequest(f"{at} must be an object of option labels", param=at)
        _check_range(len(criteria), at, MIN_CHOICES, MAX_CHOICES)
        options = tuple(
            Option(str(label), _description(text, f"{at}.{label}"))
            for label, text in criteria.items()
        )
        if any(not option.label for option in options):
            raise InvalidRequest(f"{at} labels must be non-empty", param=at)
        return DecisionQuestion("choice", name, instructions, options, at)
    if kind == "score":
        if not isinstance(criteria, list):
            raise InvalidRequest(f"{at} must be an array of level descriptions", param=at)
        _check_range(len(criteria), at, MIN_LEVELS, MAX_LEVELS)
        levels: list[Option] = []
        for index, text in enumerate(criteria):
            if not isinstance(text, str) or not text:
                raise InvalidRequest(f"{at}[{index}] must be a non-empty string", f"{at}[{index}]")
            levels.append(Option(text))
        return DecisionQuestion("score", name, instructions, tuple(levels), at)
    raise InvalidRequest(f"{where}.type must be one of 'noul', 'choice', 'score'", f"{where}.type")


# ---- shared ---------------------------------------------------------------------------------


def _instructions(value: Any, where: str) -> str:
    if value is None or value == "":
        raise InvalidRequest(f"{where} is required", param=where)
    return _as_text(value, where)


def _as_text(value: Any, where: str) -> str:
    """Text as it is; objects and arrays as JSON, which is how the model is shown data."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False, indent=2)
    raise InvalidRequest(f"{where} must be a string, an object or an array", param=where)


def _description(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    raise InvalidRequest(f"{where} must be a string or null", param=where)


def _check_range(count: int, where: str, low: int, high: int) -> None:
    if not low <= count <= high:
        raise InvalidRequest(f"{where} must have {low} to {high} items, not {count}", param=where)


def _check_unique(options: list[Option], where: str) -> None:
    labels = [option.label for option in options]
    if len(set(labels)) != len(labels):
        raise InvalidRequest(f"{where} has duplicate values", param=where)
