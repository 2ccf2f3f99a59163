"""End to end: a forced tool call closes in every family's tool-call dialect. A tiny random model
of each family, carrying that family's chat template (so the server picks the dialect the
template names: Llama 3 JSON, Llama 3.2's pythonic list, Qwen's `<tool_call>`, Mistral's
`[TOOL_CALLS]`, Phi-4-mini's and Granite's `<|tool_call|>`, Gemma's tool_code), is forced to call
a tool at the tightest budget the server allows, at a loose one, and with none: every answer is
one call whose arguments validate, ended by `tool_calls` within the budget. Without max_tokens
the bound is the room the context leaves after the prompt (this server sets no --max-tokens).

Random weights are the hard case: left alone, such a model writes into a free string or an
open array until its budget runs out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from family_templates import template
from tiny_models import make_tiny_checkpoint

from modelhost.assembly import build_serving
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow

# dialect → (architecture, the family's template fixture, the dialect the server must pick)
DIALECTS = {
    "llama3-json": ("llama", "llama3", "llama3-json"),
    "llama3.2-pythonic": ("llama", "llama3_2_pythonic", "pythonic"),
    "qwen3-tool_call": ("qwen3", "qwen3", "hermes"),
    "mistral-TOOL_CALLS": ("mistral", "mistral", "mistral"),
    "phi4-mini-tool_call": ("phi3", "phi4_mini", "phi"),
    "granite3.3-tool_call": ("granite", "granite3_3", "phi"),
    "gemma3-tool_code": ("gemma3", "gemma3", "tool_code"),
}
CATALOG = {  # nested array of objects, an enum, integers, free strings, an optional array
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "rating": {"enum": ["low", "mid", "high"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "count": {"type": "integer", "minimum": 1},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["name", "count"],
            },
        },
    },
    "required": ["title", "rating", "items"],
}
TOOL: Any = {
    "type": "function",
    "function": {"name": "save_catalog", "description": "Save a catalog", "parameters": CATALOG},
}
ASK: Any = [{"role": "user", "content": "Save a catalog of every fruit you know."}]


class Served:
    def __init__(self, base_url: str, model: LoadedModel) -> None:
        self.base_url = base_url
        self.model = model


@pytest.fixture(scope="module", params=sorted(DIALECTS))
def served(
    request: pytest.FixtureRequest,
    smollm2: LoadedModel,
    tmp_path_factory: pytest.TempPathFactory,
    module_live_server: Any,
) -> Iterator[Served]:
    architecture, fixture, _ = DIALECTS[request.param]
    directory = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}"
    make_tiny_checkpoint(directory, architecture, smollm2, max_position_embeddings=640)
    Path(directory / "chat_template.jinja").write_text(template(fixture))
    model = load_model(str(directory))
    server = module_live_server(build_serving(model, ServeSettings(), batch=2, max_queue=4))
    yield Served(server.base_url, model)


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=300
    ) as client:
        yield client


def minimum(client: openai.OpenAI, model: str) -> int:
    """The fewest tokens the shortest forced call takes, as the 400 for max_tokens=1 says."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model, messages=ASK, tools=[TOOL], tool_choice="required", max_tokens=1
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "max_tokens_too_small"
    found = re.search(r"at least (\d+)", error["message"])
    assert found is not None
    return int(found.group(1))


def test_the_server_picks_the_dialect_the_template_names(served: Served, request: Any) -> None:
    dialect = DIALECTS[request.node.callspec.params["served"]][2]

    assert served.model.family.tool_dialect.name == dialect


@pytest.mark.parametrize(("budget", "seed"), [("min", 3), (48, 11)], ids=["min-s3", "48-s11"])
def test_a_forced_call_validates_and_ends_with_tool_calls_within_its_budget(
    client: openai.OpenAI, served: Served, budget: int | str, seed: int
) -> None:
    model = served.model.id
    max_tokens = minimum(client, model) if budget == "min" else int(budget)

    answer = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[TOOL],
        tool_choice="required",
        max_tokens=max_tokens,
        temperature=0.8,
        seed=seed,
    )

    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert answer.usage is not None and answer.usage.completion_tokens <= max_tokens
    [call] = choice.message.tool_calls or []
    assert call.function.name == "save_catalog"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), CATALOG)  # type: ignore[union-attr]
    assert not choice.message.content


def test_a_streamed_forced_call_at_the_minimum_validates_with_no_markup_in_the_content(
    client: openai.OpenAI, served: Served
) -> None:
    model = served.model.id
    max_tokens = minimum(client, model)

    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[TOOL],
        tool_choice="required",
        max_tokens=max_tokens,
        temperature=0.8,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )

    chunks = list(stream)
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert not "".join(delta.content or "" for delta in deltas)
    [[call]] = [delta.tool_calls for delta in deltas if delta.tool_calls]
    jsonschema.validate(json.loads(call.function.arguments or ""), CATALOG)  # type: ignore[union-attr]
    [finish] = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    [usage] = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert finish == "tool_calls" and usage.completion_tokens <= max_tokens


def test_a_forced_call_without_max_tokens_ends_within_the_room_the_context_leaves(
    client: openai.OpenAI, served: Served
) -> None:
    model = served.model.id
    [card] = [row for row in client.models.list().data if row.id == model]
    context = card.model_extra["context_window"]  # type: ignore[index]

    answer = client.chat.completions.create(
        model=model, messages=ASK, tools=[TOOL], tool_choice="required", temperature=0.8, seed=3
    )

    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens <= context
    [call] = choice.message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), CATALOG)  # type: ignore[union-attr]
