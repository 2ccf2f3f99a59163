"""What Codex sends to /v1/responses, read by the official OpenAI SDK from a real server: every
tool type is offered, answered, or named as not offered; a forced hosted tool is a 400; Codex's
own fields pass; a cut answer says so on its items too."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import openai
import pytest
from openai.types.responses import (
    ResponseCustomToolCall,
    ResponseCustomToolCallInputDeltaEvent,
    ResponseCustomToolCallInputDoneEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
)
from scripted_engine import TOOLS_TEMPLATE, ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.inference.contracts import GrammarSpec, InferenceResult, Usage
from modelhost.server.responses import routes, tools
from modelhost.server.responses.store import ResponseStore
from modelhost.server.responses.wire import template_messages
from modelhost.text.tool_calls import ToolCall

AppFactory = Callable[..., Starlette]
OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
FUNCTION_NAMES = (
    "shell", "update_plan", "view_image", "write_stdin", "list_mcp_resources",
    "list_mcp_resource_templates", "read_mcp_resource",
)  # fmt: skip
APPLY_PATCH_LARK = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_line+
filename: /(.+)/
add_line: "+" /(.*)/ LF
change_line: ("+" | "-" | " ") /(.*)/ LF
%import common.LF
"""
SPAWN_AGENT = {
    "type": "function",
    "name": "spawn_agent",
    "description": "Start a sub-agent on a task.",
    "parameters": {"type": "object", "properties": {"task": {"type": "string"}}},
}
CODEX_TOOLS: list[dict[str, Any]] = [
    *({"type": "function", "name": name, "description": name, "strict": False,
       "parameters": OBJECT} for name in FUNCTION_NAMES),
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
     "tools": [SPAWN_AGENT]},
    {"type": "web_search", "external_web_access": False},
    {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
     "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK}},
]  # fmt: skip
ENVIRONMENT = "<environment_context><cwd>/src</cwd></environment_context>"
CODEX_BODY: dict[str, Any] = {
    "model": "gpt-5-codex",
    "instructions": "You are Codex, a coding agent.",
    "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions>workspace-write</permissions>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": ENVIRONMENT}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Fix the failing test."}]},
    ],
    "tools": CODEX_TOOLS,
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "019a-thread-id",
    "text": {"verbosity": "low"},
}  # fmt: skip
SPAWN_CALL = (
    "<tool_call>",
    '{"name": "multi_agent_v1__spawn_agent", "arguments": {"task": "run the tests"}}',
    "</tool_call>",
)


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)


AGENT_CONTEXT = 65_536


def serve(make_app: AppFactory, live_server: Any, engine: ScriptedEngine, **model: Any) -> str:
    # An agent's tools under the built-in tool prompt, one token a character: a long prompt.
    engine.context_length = AGENT_CONTEXT
    model.setdefault("context_length", AGENT_CONTEXT)
    server = live_server(make_app(engine, scripted_model(**model)))
    return str(server.base_url)


def prompt_of(engine: ScriptedEngine) -> str:
    return scripted_model().tokenizer.decode(engine.submissions[-1].prompt_ids, False)


# ---- Codex's request ---------------------------------------------------------------------------


def test_a_codex_turn_streams_to_completion_with_web_search_named_as_not_offered(
    make_app: AppFactory, live_server: Any
) -> None:
    base_url = serve(make_app, live_server, ScriptedEngine())
    with openai_client(base_url) as client:
        raw = client.responses.with_raw_response.create(**{**CODEX_BODY, "stream": False})
    response = raw.parse()
    assert raw.headers["x-modelhost-tools-not-offered"] == "web_search"
    assert response.status == "completed"
    assert response.output_text == "Hello, world!"
    assert response.prompt_cache_key == "019a-thread-id"
    assert response.parallel_tool_calls is False
    assert [tool.type for tool in response.tools] == ["function"] * 7 + ["namespace", "custom"]


def test_a_codex_stream_ends_with_response_completed(
    make_app: AppFactory, live_server: Any
) -> None:
    base_url = serve(make_app, live_server, ScriptedEngine())
    with openai_client(base_url) as client:
        events = list(client.responses.create(**CODEX_BODY))
    assert events[-1].type == "response.completed"
    assert events[-1].response.store is False  # type: ignore[union-attr]


def test_the_model_is_offered_functions_namespaced_functions_and_the_custom_tool(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine()
    base_url = serve(make_app, live_server, engine, template=TOOLS_TEMPLATE)
    with openai_client(base_url) as client:
        client.responses.create(**{**CODEX_BODY, "stream": False})
    offered = [json.loads(line) for line in prompt_of(engine).split("\n") if line.startswith("{")]
    names = [tool["function"]["name"] for tool in offered]
    assert names == [*FUNCTION_NAMES, "multi_agent_v1__spawn_agent", "apply_patch"]
    # A template with its own tool format sees the freeform tool as a function of its input,
    # its grammar in the description.
    patch = offered[-1]["function"]
    assert patch["description"].startswith("Edit files with a patch.")
    assert APPLY_PATCH_LARK.strip() in patch["description"]
    assert patch["parameters"]["required"] == ["input"]


def test_the_log_line_names_the_tools_not_offered(
    make_app: AppFactory, live_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelhost.server")
    base_url = serve(make_app, live_server, ScriptedEngine())
    body = {**CODEX_BODY, "stream": False}
    body["tools"] = [*CODEX_TOOLS, {"type": "file_search", "vector_store_ids": ["vs_1"]}]
    with openai_client(base_url) as client:
        client.responses.create(**body)
    assert "POST /v1/responses 200 " in caplog.text
    assert "tools_not_offered=web_search,file_search" in caplog.text


@pytest.mark.parametrize("kind", ["web_search", "file_search", "image_generation"])
def test_forcing_a_hosted_tool_is_a_400_that_names_it(
    make_app: AppFactory, live_server: Any, kind: str
) -> None:
    base_url = serve(make_app, live_server, ScriptedEngine())
    body = {**CODEX_BODY, "stream": False, "tools": [*CODEX_TOOLS, {"type": kind}]}
    with openai_client(base_url) as client, pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{**body, "tool_choice": {"type": kind}})
    assert f"tool_choice forces the {kind} tool" in refused.value.message


# ---- Namespaced calls --------------------------------------------------------------------------


def test_a_namespaced_call_is_a_function_call_item_in_its_namespace(
    make_app: AppFactory, live_server: Any
) -> None:
    base_url = serve(make_app, live_server, ScriptedEngine(SPAWN_CALL), family="qwen3")
    with openai_client(base_url) as client:
        response = client.responses.create(**{**CODEX_BODY, "stream": False})
    [call] = [item for item in response.output if item.type == "function_call"]
    assert (call.namespace, call.name) == ("multi_agent_v1", "spawn_agent")
    assert json.loads(call.arguments) == {"task": "run the tests"}


def test_a_streamed_namespaced_call_names_its_namespace_in_its_done_item(
    make_app: AppFactory, live_server: Any
) -> None:
    base_url = serve(make_app, live_server, ScriptedEngine(SPAWN_CALL), family="qwen3")
    with openai_client(base_url) as client:
        events = list(client.responses.create(**CODEX_BODY))
    done = [event for event in events if event.type == "response.output_item.done"]
    item = done[-1].item  # type: ignore[union-attr]
    assert (item.type, item.namespace, item.name) == (
        "function_call",
        "multi_agent_v1",
        "spawn_agent",
    )  # type: ignore[union-attr]


def test_a_namespaced_call_in_the_history_is_shown_under_its_flat_name(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine()
    base_url = serve(make_app, live_server, engine, template=TOOLS_TEMPLATE)
    call = {"type": "function_call", "call_id": "c1", "namespace": "multi_agent_v1",
            "name": "spawn_agent", "arguments": "{}"}  # fmt: skip
    output = {"type": "function_call_output", "call_id": "c1", "output": "agent 7 started"}
    body = {**CODEX_BODY, "stream": False, "input": [*CODEX_BODY["input"], call, output]}
    with openai_client(base_url) as client:
        assert client.responses.create(**body).status == "completed"
    messages, _, _ = template_messages(body["input"], None)
    assert messages[-2]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert "<|im_start|>tool\nagent 7 started<|im_end|>" in prompt_of(engine)


# ---- Custom (freeform) tools -------------------------------------------------------------------

PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n"
CUSTOM_CALL = ToolCall("call_patch1", "apply_patch", "{}", input=PATCH)


def codex_turn() -> routes.Turn:
    return routes.parse_turn({**CODEX_BODY, "stream": False}, lambda _: None, "resp_1")


def test_a_custom_call_is_a_custom_tool_call_item_with_its_raw_input() -> None:
    usage = Usage(10, 5, 0)
    result = InferenceResult("resp_1", "", "tool_calls", usage, None, tool_calls=(CUSTOM_CALL,))
    [item] = routes.output_items(result, codex_turn().tools)
    call = ResponseCustomToolCall.model_validate(item)
    assert (call.type, call.call_id, call.name, call.input) == (
        "custom_tool_call", "call_patch1", "apply_patch", PATCH,
    )  # fmt: skip


def test_a_streamed_custom_call_sends_its_input_events_which_the_sdk_parses() -> None:
    stream = routes.ResponseStream(codex_turn(), ResponseStore())
    stream.start()
    frames = stream.finish(
        routes.CompletionEvent(finish_reason="tool_calls", usage=Usage(10, 5, 0),
                               tool_calls=(CUSTOM_CALL,))
    )  # fmt: skip
    events = [json.loads(frame.split("data: ", 1)[1]) for frame in frames]
    kinds = [event["type"] for event in events]
    assert kinds == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = ResponseOutputItemAddedEvent.model_validate(events[0])
    delta = ResponseCustomToolCallInputDeltaEvent.model_validate(events[1])
    done = ResponseCustomToolCallInputDoneEvent.model_validate(events[2])
    finished = ResponseOutputItemDoneEvent.model_validate(events[3])
    assert added.item.type == "custom_tool_call"
    assert delta.delta == done.input == PATCH
    assert finished.item.input == PATCH  # type: ignore[union-attr]


def test_custom_call_items_in_the_history_become_a_custom_call_and_a_tool_turn() -> None:
    items = [
        {"role": "user", "content": "Add hello.txt"},
        {"type": "custom_tool_call", "call_id": "c9", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "c9", "output": "Done!"},
    ]
    messages, _, _ = template_messages(items, None)
    assert messages[1:] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c9", "type": "custom",
                         "custom": {"name": "apply_patch", "input": PATCH}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "Done!"},
    ]  # fmt: skip


def test_forcing_a_custom_tool_holds_the_answer_to_its_input_block_and_grammar() -> None:
    body = {**CODEX_BODY, "tool_choice": {"type": "custom", "name": "apply_patch"}}
    turn = routes.parse_turn(body, lambda _: None, "resp_2")
    grammar = turn.inference.grammar
    assert grammar is not None and grammar.kind == "structural_tag"
    tag = json.loads(grammar.source)["format"]
    assert tag["begin"] == '<tool_input name="apply_patch">\n'
    assert tag["content"] == {"type": "grammar", "grammar": APPLY_PATCH_LARK, "syntax": "lark"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_freeform_input_the_model_writes_is_a_custom_tool_call_item_for_the_sdk(
    make_app: AppFactory, live_server: Any, stream: bool
) -> None:
    script = ('<tool_input name="apply_patch">\n', *PATCH.splitlines(keepends=True))
    base_url = serve(make_app, live_server, ScriptedEngine((*script, "</tool_input>")))
    with openai_client(base_url) as client:
        if stream:
            body = {key: value for key, value in CODEX_BODY.items() if key != "stream"}
            with client.responses.stream(**body) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(**{**CODEX_BODY, "stream": False})
    [call] = response.output
    assert isinstance(call, ResponseCustomToolCall)
    assert (call.name, call.input) == ("apply_patch", PATCH)


# ---- Codex's other fields and cut answers -------------------------------------------------------


def test_a_developer_message_after_the_conversation_began_stays_in_place(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine()
    base_url = serve(make_app, live_server, engine)
    later = {"type": "message", "role": "developer", "content": "Approvals are now off."}
    body = {**CODEX_BODY, "stream": False, "input": [*CODEX_BODY["input"], later]}
    with openai_client(base_url) as client:
        client.responses.create(**body)
    prompt = prompt_of(engine)
    assert prompt.startswith(
        "<|im_start|>system\nYou are Codex, a coding agent.\n\n"
        "<permissions>workspace-write</permissions>\n\n# Tools"  # the built-in tool prompt
    )
    assert prompt.endswith(
        "Fix the failing test.<|im_end|>\n<|im_start|>system\nApprovals are now off.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_an_answer_cut_by_max_output_tokens_is_incomplete_on_its_message_too(
    make_app: AppFactory, live_server: Any
) -> None:
    base_url = serve(make_app, live_server, ScriptedEngine())
    body = {**CODEX_BODY, "max_output_tokens": 2}
    with openai_client(base_url) as client:
        whole = client.responses.create(**{**body, "stream": False})
        events = list(client.responses.create(**body))
    assert whole.status == "incomplete"
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in whole.output] == ["incomplete"]  # type: ignore[union-attr]
    done = [event for event in events if event.type == "response.output_item.done"]
    assert done[-1].item.status == "incomplete"  # type: ignore[union-attr]
    assert events[-1].response.status == "incomplete"  # type: ignore[union-attr]


def test_allowed_tools_in_required_mode_forces_a_call_among_the_allowed_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[Any, str | None]] = []

    def forced_call(offered: Any, name: str | None) -> tuple[GrammarSpec, str]:
        asked.append((offered, name))
        return GrammarSpec("regex", ".*", field="tools"), "Call a tool."

    monkeypatch.setattr(tools, "forced_call", forced_call)
    spawn = {"type": "function", "namespace": "multi_agent_v1", "name": "spawn_agent"}
    allowed = [{"type": "function", "name": "shell"}, spawn]
    choice = {"type": "allowed_tools", "mode": "required", "tools": allowed}
    turn = routes.parse_turn({**CODEX_BODY, "tool_choice": choice}, lambda _: None, "resp_3")
    [(offered, name)] = asked
    assert name is None
    assert [tool["function"]["name"] for tool in offered] == [
        "shell",
        "multi_agent_v1__spawn_agent",
    ]
    assert turn.inference.prompt.tools == offered  # type: ignore[union-attr]
