"""Tools reach every model: where a chat template cannot render them (SmolLM2's), the built-in
tool prompt declares them, on every surface, and what the model writes back in that shape comes
back as each surface's tool calls; a model left to choose gets a grammar that holds an opened
call to its schema."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from scripted_engine import TOOLS_TEMPLATE, ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.assembly import build_serving
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

AppFactory = Callable[..., Starlette]
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "the city, in English"}},
    "required": ["city"],
}
DESCRIPTION = "Current weather for a city, in degrees Celsius"
OPENAI_TOOL: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS},
}
ANTHROPIC_TOOL: Any = {
    "name": "get_weather",
    "description": DESCRIPTION,
    "input_schema": PARAMETERS,
}
RESPONSES_TOOL: Any = {"type": "function", **OPENAI_TOOL["function"]}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello\n*** End Patch\n"
APPLY_PATCH: Any = {
    "type": "custom",
    "custom": {"name": "apply_patch", "description": "Edit files with a patch"},
}


# ---------------------------------------------------------------------------------------------
# Both embedded chat models, on every surface: the declarations are in the prompt


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def embedded(request: pytest.FixtureRequest, module_live_server: Any) -> tuple[str, LoadedModel]:
    model: LoadedModel = request.getfixturevalue(request.param)
    server = module_live_server(build_serving(model, ServeSettings(), batch=2, max_queue=8))
    return server.base_url, model


def declared_tokens(model: LoadedModel) -> int:
    """At least what the tool's description and schema take: what must reach the model."""
    text = DESCRIPTION + json.dumps(PARAMETERS)
    return len(model.tokenizer.encode(text, add_special_tokens=False)) // 2


slow = pytest.mark.slow


@slow
def test_chat_usage_counts_the_tools_the_model_read(embedded: tuple[str, LoadedModel]) -> None:
    base_url, model = embedded
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
        bare = client.chat.completions.create(model=model.id, messages=ASK, max_tokens=1)
        tooled = client.chat.completions.create(
            model=model.id, messages=ASK, max_tokens=1, tools=[OPENAI_TOOL]
        )
    assert bare.usage is not None and tooled.usage is not None
    assert tooled.usage.prompt_tokens - bare.usage.prompt_tokens > declared_tokens(model)


@slow
def test_anthropic_count_tokens_counts_the_tools_the_model_read(
    embedded: tuple[str, LoadedModel],
) -> None:
    base_url, model = embedded
    with anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0) as client:
        bare = client.messages.count_tokens(model=model.id, messages=ASK)
        tooled = client.messages.count_tokens(model=model.id, messages=ASK, tools=[ANTHROPIC_TOOL])
        answered = client.messages.create(
            model=model.id, messages=ASK, max_tokens=1, tools=[ANTHROPIC_TOOL]
        )
    assert tooled.input_tokens - bare.input_tokens > declared_tokens(model)
    usage = answered.usage  # Anthropic's input_tokens leaves out what the cache served
    read = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert read + (usage.cache_creation_input_tokens or 0) == tooled.input_tokens


@slow
def test_responses_usage_counts_the_tools_the_model_read(
    embedded: tuple[str, LoadedModel],
) -> None:
    base_url, model = embedded
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
        bare = client.responses.create(model=model.id, input=ASK, max_output_tokens=16)
        tooled = client.responses.create(
            model=model.id, input=ASK, max_output_tokens=16, tools=[RESPONSES_TOOL]
        )
    assert bare.usage is not None and tooled.usage is not None
    assert tooled.usage.input_tokens - bare.usage.input_tokens > declared_tokens(model)


@slow
def test_ollama_prompt_eval_count_counts_the_tools_the_model_read(
    embedded: tuple[str, LoadedModel],
) -> None:
    base_url, model = embedded
    counts = []
    for tools in ([], [OPENAI_TOOL]):
        body = {"model": model.id, "messages": ASK, "tools": tools, "stream": False}
        body["options"] = {"num_predict": 1}
        reply = httpx.post(f"{base_url}/api/chat", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        counts.append(reply.json()["prompt_eval_count"])
    assert counts[1] - counts[0] > declared_tokens(model)


@slow
def test_listings_say_a_model_reads_tools_because_it_does(
    embedded: tuple[str, LoadedModel],
) -> None:
    base_url, model = embedded
    shown = httpx.post(f"{base_url}/api/show", json={"model": model.id}, timeout=30).json()
    assert "tools" in shown["capabilities"]


# ---------------------------------------------------------------------------------------------
# A scripted model under the built-in prompt: the calls it writes come back as calls


def start(
    make_app: AppFactory, live_server: Any, script: tuple[str, ...], template: str | None = None
) -> tuple[str, ScriptedEngine]:
    engine = ScriptedEngine(script)
    model = scripted_model(template=template) if template else scripted_model()
    return live_server(make_app(engine, model)).base_url, engine


def test_a_call_written_in_the_built_in_shape_is_a_chat_tool_call(
    make_app: AppFactory, live_server: Any
) -> None:
    script = ("Checking.", "<tool_call>\n", '{"name": "get_weather", "arguments": ')
    script += ('{"city": "Paris"}}', "\n</tool_call>")
    base_url, _ = start(make_app, live_server, script)
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(model="m", messages=ASK, tools=[OPENAI_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_a_freeform_input_comes_back_as_a_custom_tool_call_whole(
    make_app: AppFactory, live_server: Any, stream: bool
) -> None:
    script = ('<tool_input name="apply_patch">\n', *PATCH.splitlines(keepends=True))
    base_url, _ = start(make_app, live_server, (*script, "</tool_input>"))
    body = {"model": "m", "messages": ASK, "tools": [APPLY_PATCH], "stream": stream}
    with httpx.Client(base_url=base_url, timeout=30) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line[6:7] == "{"]
        calls = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        calls = response.json()["choices"][0]["message"]["tool_calls"]
        finish = response.json()["choices"][0]["finish_reason"]
    [call] = calls
    assert finish == "tool_calls"
    assert call["type"] == "custom"
    assert call["custom"] == {"name": "apply_patch", "input": PATCH}


def test_a_model_left_to_choose_gets_a_grammar_that_waits_for_a_call(
    make_app: AppFactory, live_server: Any
) -> None:
    base_url, engine = start(make_app, live_server, ("Sunny.",))
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(model="m", messages=ASK, tools=[OPENAI_TOOL])
        client.chat.completions.create(
            model="m", messages=ASK, tools=[OPENAI_TOOL], tool_choice="none"
        )
    assert reply.choices[0].message.content == "Sunny."  # free text still passes
    chosen, declined = engine.submissions
    assert chosen.params.grammar is not None
    assert declined.params.grammar is None


def test_a_template_that_renders_tools_keeps_its_own_format_and_no_lazy_grammar(
    make_app: AppFactory, live_server: Any
) -> None:
    base_url, engine = start(make_app, live_server, ("Sunny.",), TOOLS_TEMPLATE)
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
        client.chat.completions.create(model="m", messages=ASK, tools=[OPENAI_TOOL, APPLY_PATCH])
    [submission] = engine.submissions
    prompt = scripted_model().tokenizer.decode(submission.prompt_ids, False)
    assert prompt.startswith('{"type": "function"')
    assert '"name": "apply_patch"' in prompt  # a freeform tool, as a function of `input`
    assert "# Tools" not in prompt
    assert submission.params.grammar is None
