"""Typed decisions over HTTP: `POST /v1/decisions` (OpenAI's shape) and `POST /v1/systemone`
(TypeSafe System One / Jev's shape). Both translate their wire shape into one DecisionRequest,
run it on the leased model's stage (`inference.decisions`) and reshape the answers; errors use
OpenAI's error shape, with `param` naming the field.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from modelhost.inference.decision_prompt import DecisionRequest
from modelhost.inference.decisions import DecisionAnswer, DecisionResult, decide
from modelhost.server.decisions.wire import parse_decisions, parse_systemone
from modelhost.server.exchange import answer_json
from modelhost.server.http import RequestLog, serving_stage
from modelhost.server.openai.wire import new_id, openai_error

DECISIONS_ROUTE = "POST /v1/decisions"
SYSTEMONE_ROUTE = "POST /v1/systemone"


async def create_decision(request: Request) -> Response:
    return await _answer(request, new_id("dec"), DECISIONS_ROUTE, parse_decisions, decisions_json)


async def create_systemone(request: Request) -> Response:
    def render(request_id: str, model: str, result: DecisionResult) -> dict[str, Any]:
        return systemone_json(model, result)

    return await _answer(request, new_id("sys1"), SYSTEMONE_ROUTE, parse_systemone, render)


async def _answer(
    request: Request,
    request_id: str,
    route: str,
    parse: Callable[[dict[str, Any], str], DecisionRequest],
    render: Callable[[str, str, DecisionResult], dict[str, Any]],
) -> Response:
    """One wire shape in, one out; parsing, routing, running and errors are shared."""
    log = RequestLog(request_id, route)

    async def answer(body: dict[str, Any]) -> dict[str, Any]:
        decision = parse(body, log.request_id)
        stage = serving_stage(request, body.get("model"))
        return render(log.request_id, stage.model_id, await decide(stage, decision))

    return await answer_json(request, log, openai_error, answer)


def decisions_json(request_id: str, model: str, result: DecisionResult) -> dict[str, Any]:
    usage = result.usage
    return {
        "id": request_id,
        "object": "decision",
        "created": int(time.time()),
        "model": model,
        "answers": [_decision_answer(answer) for answer in result.answers],
        "usage": {
            "input_tokens": usage.input_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        },
    }


def _decision_answer(answer: DecisionAnswer) -> dict[str, Any]:
    question = answer.question
    options = question.options
    if question.kind == "binary":
        return {"type": "predicate", "name": question.name, "probability": answer.probabilities[0]}
    if question.kind == "choice":
        return {
            "type": "choice",
            "name": question.name,
            "choice": options[answer.best].label,
            "probabilities": [
                {"value": option.label, "probability": p}
                for option, p in zip(options, answer.probabilities, strict=True)
            ],
            "confidence": answer.confidence,
        }
    return {
        "type": "score",
        "name": question.name,
        "score": answer.score,
        "probabilities": [
            {"value": level, "label": option.label, "probability": p}
            for level, (option, p) in enumerate(zip(options, answer.probabilities, strict=True))
        ],
        "confidence": answer.confidence,
    }


def systemone_json(model: str, result: DecisionResult) -> dict[str, Any]:
    answers = {str(answer.question.name): _systemone_answer(answer) for answer in result.answers}
    usage = {"input_tokens": result.usage.input_tokens, "output_tokens": result.usage.output_tokens}
    return {"model": model, "answers": answers, "usage": usage}


def _systemone_answer(answer: DecisionAnswer) -> dict[str, Any]:
    question = answer.question
    if question.kind == "binary":
        return {"type": "noul", "noul": answer.probabilities[0]}  # no confidence, as TypeSafe
    if question.kind == "choice":
        labels = [option.label for option in question.options]
        return {
            "type": "choice",
            "choice": labels[answer.best],
            "probabilities": dict(zip(labels, answer.probabilities, strict=True)),
            "confidence": answer.confidence,
        }
    return {
        "type": "score",
        "score": answer.score,
        "legend": {str(i): option.label for i, option in enumerate(question.options)},
        "probabilities": {str(i): p for i, p in enumerate(answer.probabilities)},
        "confidence": answer.confidence,
    }
