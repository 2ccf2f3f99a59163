"""What Claude Code sends to /v1/messages, read by the official Anthropic SDK from a real server:
its fields never 400, its server tools are named as not offered (a 400 when forced), the tools
whose schema Anthropic defines are offered, cache usage is reported as it happened, and the
volatile billing line never reaches the prompt."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import pytest
from scripted_engine import TOOLS_TEMPLATE, ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.assembly import build_serving
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

AppFactory = Callable[..., Starlette]
BILLING = "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=cli; cch=3f2a9;"
SYSTEM_PROMPT = (
    "You are an interactive CLI tool that helps users with software engineering tasks. "
    "Use the instructions below and the tools available to you to assist the user. "
    "Keep your answers short; prefer editing existing files to creating new ones. "
) * 3
CACHED = {"type": "ephemeral"}
BASH = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                     "required": ["command"]},
}  # fmt: skip
READ = {
    "name": "Read",
    "description": "Read a file.",
    "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
    "cache_control": CACHED,
}
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
CLAUDE_CODE_BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 1024,
    "system": [
        {"type": "text", "text": BILLING},
        {"type": "text", "text": "You are Claude Code, Anthropic's CLI.", "cache_control": CACHED},
        {"type": "text", "text": SYSTEM_PROMPT, "cache_control": CACHED},
    ],
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Today is Monday.</system-reminder>"},
            {"type": "text", "text": "Fix the failing test.", "cache_control": CACHED},
        ]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Running the tests."},
            {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "pytest"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "1 failed"},
        ]},
        {"role": "system", "content": "The user switched to plan mode."},
        {"role": "user", "content": "Go on."},
    ],
    "tools": [BASH, READ, WEB_SEARCH],
    "tool_choice": {"type": "auto"},
    "thinking": {"type": "adaptive"},
    "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "metadata": {"user_id": "user_abc_account_1_session_2"},
}  # fmt: skip


def anthropic_client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0)


AGENT_CONTEXT = 65_536


def serve(make_app: AppFactory, live_server: Any, engine: ScriptedEngine, **model: Any) -> str:
    # An agent's tools under the built-in tool prompt, one token a character: a long prompt.
    engine.context_length = AGENT_CONTEXT
    model.setdefault("context_length", AGENT_CONTEXT)
    return str(live_server(make_app(engine, scripted_model(**model))).base_url)


def create(base_url: str, body: dict[str, Any], read: Any = None) -> Any:
    """The raw answer to `body` (Claude Code's fields the SDK's types lack go as they are);
    `read(raw)`, when given, reads it while the client is open (a stream is read from its
    connection) and is what comes back."""
    known = ("model", "max_tokens", "system", "messages", "tools", "tool_choice", "metadata",
             "stream")  # fmt: skip
    extra = {key: value for key, value in body.items() if key not in known}
    with anthropic_client(base_url) as client:
        raw = client.messages.with_raw_response.create(
            **{key: body[key] for key in known if key in body}, extra_body=extra
        )
        return raw if read is None else read(raw)


def prompt_of(engine: ScriptedEngine) -> str:
    return scripted_model().tokenizer.decode(engine.submissions[-1].prompt_ids, False)


def test_a_claude_code_turn_is_answered_with_web_search_named_as_not_offered(
    make_app: AppFactory, live_server: Any
) -> None:
    raw = create(serve(make_app, live_server, ScriptedEngine()), CLAUDE_CODE_BODY)
    message = raw.parse()
    assert raw.headers["x-modelhost-tools-not-offered"] == "web_search_20250305"
    assert message.content[0].text == "Hello, world!"
    assert message.stop_reason == "end_turn"


def test_a_streamed_claude_code_turn_ends_with_message_stop(
    make_app: AppFactory, live_server: Any
) -> None:
    base_url = serve(make_app, live_server, ScriptedEngine())
    headers, kinds = create(
        base_url,
        {**CLAUDE_CODE_BODY, "stream": True},
        lambda raw: (raw.headers, [event.type for event in raw.parse()]),
    )
    assert headers["x-modelhost-tools-not-offered"] == "web_search_20250305"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


@pytest.mark.parametrize(
    "thinking",
    [{"type": "adaptive"}, {"type": "enabled", "budget_tokens": 10000}, {"type": "disabled"}],
)
def test_every_thinking_setting_claude_code_sends_is_accepted(
    make_app: AppFactory, live_server: Any, thinking: dict[str, Any]
) -> None:
    raw = create(
        serve(make_app, live_server, ScriptedEngine()), {**CLAUDE_CODE_BODY, "thinking": thinking}
    )
    assert raw.parse().stop_reason == "end_turn"


def test_a_system_message_inside_messages_stays_where_it_was_sent(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine()
    create(serve(make_app, live_server, engine), CLAUDE_CODE_BODY)
    prompt = prompt_of(engine)
    assert prompt.startswith("<|im_start|>system\nYou are Claude Code, Anthropic's CLI.\n\n")
    assert prompt.count("<|im_start|>system") == 2
    assert prompt.index("<tool_response>\n1 failed") < prompt.index(
        "<|im_start|>system\nThe user switched to plan mode.<|im_end|>\n<|im_start|>user\nGo on."
    )


def test_the_billing_line_never_reaches_the_prompt_whatever_its_checksum(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine()
    base_url = serve(make_app, live_server, engine)
    prompts = []
    for checksum in ("3f2a9", "b71c0"):
        system = [{"type": "text", "text": BILLING.replace("3f2a9", checksum)}]
        create(base_url, {**CLAUDE_CODE_BODY, "system": [*system, *CLAUDE_CODE_BODY["system"][1:]]})
        prompts.append(engine.submissions[-1].prompt_ids)
    assert prompts[0] == prompts[1]
    assert "x-anthropic-billing-header" not in prompt_of(engine)


def test_usage_reports_the_tokens_read_from_the_prefix_cache_and_no_cache_writes(
    make_app: AppFactory, live_server: Any
) -> None:
    plain = create(serve(make_app, live_server, ScriptedEngine()), CLAUDE_CODE_BODY).parse()
    base_url = serve(make_app, live_server, ScriptedEngine(cached_tokens=64))
    usage = create(base_url, CLAUDE_CODE_BODY).parse().usage
    assert usage.cache_read_input_tokens == 64
    assert usage.cache_creation_input_tokens == 0
    assert usage.input_tokens == plain.usage.input_tokens - 64


def test_forcing_the_web_search_server_tool_is_a_400_that_names_it(
    make_app: AppFactory, live_server: Any
) -> None:
    base_url = serve(make_app, live_server, ScriptedEngine())
    body = {**CLAUDE_CODE_BODY, "tool_choice": {"type": "tool", "name": "web_search"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(base_url, body)
    assert "tool_choice forces the web_search (web_search_20250305) tool" in str(refused.value)


def test_bash_and_text_editor_are_offered_with_their_documented_schemas_and_computer_is_not(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine()
    base_url = serve(make_app, live_server, engine, template=TOOLS_TEMPLATE)
    declared = [
        {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
        {"type": "computer_20250124", "name": "computer", "display_width_px": 1024,
         "display_height_px": 768},
    ]  # fmt: skip
    raw = create(base_url, {**CLAUDE_CODE_BODY, "tools": declared})
    offered = [json.loads(line) for line in prompt_of(engine).split("\n") if line.startswith("{")]
    functions = {tool["function"]["name"]: tool["function"]["parameters"] for tool in offered}
    assert sorted(functions) == ["bash", "str_replace_based_edit_tool"]
    assert functions["bash"]["properties"]["command"]["type"] == "string"
    editor = functions["str_replace_based_edit_tool"]["properties"]["command"]["enum"]
    assert editor == ["view", "create", "str_replace", "insert"]
    assert raw.headers["x-modelhost-tools-not-offered"] == "computer_20250124"


@pytest.fixture(scope="module")
def smollm2_server(smollm2: LoadedModel, module_live_server: Any) -> str:
    return str(module_live_server(build_serving(smollm2, ServeSettings(), batch=1)).base_url)


def test_two_turns_differing_only_in_the_billing_checksum_share_their_cached_prompt(
    smollm2_server: str,
) -> None:
    usages = []
    for checksum in ("3f2a9", "b71c0"):
        system = [{"type": "text", "text": BILLING.replace("3f2a9", checksum)}]
        body = {**CLAUDE_CODE_BODY, "max_tokens": 1, "tools": [BASH, READ],
                "system": [*system, *CLAUDE_CODE_BODY["system"][1:]]}  # fmt: skip
        usages.append(create(smollm2_server, body).parse().usage)
    first, second = usages
    prompt = first.input_tokens + first.cache_read_input_tokens
    assert second.input_tokens + second.cache_read_input_tokens == prompt
    assert second.cache_read_input_tokens >= 0.8 * prompt
