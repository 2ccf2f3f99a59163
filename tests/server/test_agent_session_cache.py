"""An agent's session on every surface: a system prompt and tools, then user, assistant tool-call
and tool-result turns appended; every turn after the first is served from the prefix cache but
for what it adds (cached >= 95% of its prompt), so each earlier turn renders the same way when
the conversation grows.

OpenAI chat, Anthropic Messages and Responses report the cached tokens in their usage; Ollama's
`/api/chat` has no such field (its `prompt_eval_count` counts the whole prompt), so its turns
read the server's prefix-cache counters on /metrics.

Cached tokens count blocks found in memory and blocks read back from the prefix KV store alike
(README, "Agent sessions")."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from modelhost.assembly import build_serving
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

MODEL = "smollm2-135m-instruct"
CACHED_SHARE = 0.95
TURNS = 5


def _instructions() -> str:
    rules = [
        f"Rule {i}: when a task touches module number {i}, read the file first, keep every "
        f"public name as it is, run the tests of that module, and say what changed in one line."
        for i in range(30)
    ]
    return "You are a coding agent working in a repository.\n" + "\n".join(rules)


def _tool(name: str, summary: str, fields: dict[str, str]) -> dict[str, Any]:
    properties = {key: {"type": "string", "description": text} for key, text in fields.items()}
    return {
        "name": name,
        "description": summary,
        "parameters": {"type": "object", "properties": properties, "required": list(fields)},
    }


SYSTEM = _instructions()
TOOLS = [
    _tool("read_file", "Read a file of the repository and return its text.", {"path": "a path"}),
    _tool("run_tests", "Run the test suite of one module.", {"module": "a module's name"}),
    _tool("edit_file", "Replace text in a file.", {"path": "a path", "old": "text", "new": "text"}),
]

# The session after the first user turn: (kind, payload) steps, each turn ending at a point where
# the agent asks again.
Step = tuple[str, Any]
FIRST_USER = "The parser drops the last line of a file. Find out why."
LATER_TURNS: list[list[Step]] = [
    [("call", ("c1", "read_file", {"path": "src/parser.py"})),
     ("result", ("c1", "def parse(text):\n    return text.split('\\n')[:-1]"))],
    [("call", ("c2", "run_tests", {"module": "parser"})),
     ("result", ("c2", "FAILED test_last_line - assert 2 == 3"))],
    [("text", "The slice [:-1] drops the last line."),
     ("user", "Fix it and run the tests again.")],
    [("call", ("c3", "edit_file", {"path": "src/parser.py", "old": "[:-1]", "new": ""})),
     ("result", ("c3", "edited 1 line"))],
]  # fmt: skip


# ---- each surface's wire form of the session ---------------------------------------------


def openai_messages(steps: list[Step]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for kind, payload in steps:
        if kind == "user":
            messages.append({"role": "user", "content": payload})
        elif kind == "text":
            messages.append({"role": "assistant", "content": payload})
        elif kind == "call":
            call_id, name, arguments = payload
            function = {"name": name, "arguments": json.dumps(arguments)}
            call = {"id": call_id, "type": "function", "function": function}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            call_id, output = payload
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    return messages


def anthropic_messages(steps: list[Step]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for kind, payload in steps:
        if kind == "user":
            messages.append({"role": "user", "content": payload})
        elif kind == "text":
            messages.append({"role": "assistant", "content": [{"type": "text", "text": payload}]})
        elif kind == "call":
            call_id, name, arguments = payload
            block = {"type": "tool_use", "id": call_id, "name": name, "input": arguments}
            messages.append({"role": "assistant", "content": [block]})
        else:
            call_id, output = payload
            block = {"type": "tool_result", "tool_use_id": call_id, "content": output}
            messages.append({"role": "user", "content": [block]})
    return messages


def responses_input(steps: list[Step]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for kind, payload in steps:
        if kind == "user":
            items.append({"type": "message", "role": "user", "content": payload})
        elif kind == "text":
            items.append({"type": "message", "role": "assistant", "content": payload})
        elif kind == "call":
            call_id, name, arguments = payload
            items.append(
                {
                    "type": "function_call",
                    "call_id": call_id,
                    "name": name,
                    "arguments": json.dumps(arguments),
                }
            )
        else:
            call_id, output = payload
            items.append({"type": "function_call_output", "call_id": call_id, "output": output})
    return items


def ollama_messages(steps: list[Step]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for kind, payload in steps:
        if kind == "user":
            messages.append({"role": "user", "content": payload})
        elif kind == "text":
            messages.append({"role": "assistant", "content": payload})
        elif kind == "call":
            _, name, arguments = payload
            call = {"function": {"name": name, "arguments": arguments}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            _, output = payload
            messages.append({"role": "tool", "content": output})
    return messages


def openai_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": tool} for tool in TOOLS]


# A turn: the session so far -> (prompt tokens, cached prompt tokens).
Turn = Callable[[httpx.Client, list[Step]], tuple[int, int]]


def openai_turn(client: httpx.Client, steps: list[Step]) -> tuple[int, int]:
    body = {
        "model": MODEL,
        "messages": openai_messages(steps),
        "tools": openai_tools(),
        "max_tokens": 2,
        "temperature": 0,
    }
    usage = _ok(client.post("/v1/chat/completions", json=body))["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def anthropic_turn(client: httpx.Client, steps: list[Step]) -> tuple[int, int]:
    tools = [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
        for t in TOOLS
    ]
    body = {
        "model": MODEL,
        "system": SYSTEM,
        "messages": anthropic_messages(steps),
        "tools": tools,
        "max_tokens": 2,
        "temperature": 0,
    }
    usage = _ok(client.post("/v1/messages", json=body))["usage"]
    cached = usage.get("cache_read_input_tokens", 0)
    return usage["input_tokens"] + cached, cached


def responses_turn(client: httpx.Client, steps: list[Step]) -> tuple[int, int]:
    body = {
        "model": MODEL,
        "instructions": SYSTEM,
        "input": responses_input(steps),
        "tools": [{"type": "function", **tool} for tool in TOOLS],
        "max_output_tokens": 2,
        "temperature": 0,
        "store": False,
    }
    usage = _ok(client.post("/v1/responses", json=body))["usage"]
    return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


def ollama_turn(client: httpx.Client, steps: list[Step]) -> tuple[int, int]:
    before = _prefix_counters(client)
    body = {
        "model": MODEL,
        "messages": ollama_messages(steps),
        "tools": openai_tools(),
        "stream": False,
        "options": {"num_predict": 2, "temperature": 0},
    }
    reply = _ok(client.post("/api/chat", json=body))
    (queried_after, hits_after), (queried_before, hits_before) = _prefix_counters(client), before
    queried, hits = queried_after - queried_before, hits_after - hits_before
    assert queried == reply["prompt_eval_count"]
    return reply["prompt_eval_count"], hits


def _prefix_counters(client: httpx.Client) -> tuple[int, int]:
    text = client.get("/metrics").text

    def counter(name: str) -> int:
        found = re.findall(rf"^{name}(?:_total)?\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
        return int(sum(float(value) for value in found))

    return (
        counter("modelhost_prefix_cache_query_tokens"),
        counter("modelhost_prefix_cache_hit_tokens"),
    )


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def client(smollm2: LoadedModel, module_live_server: Any) -> Iterator[httpx.Client]:
    # The prefix KV store on, as `modelhost serve` has it: an idle engine keeps IDLE_KV_BYTES
    # of its prefix cache in memory (~1,450 of SmolLM2's tokens) and reads the rest of a
    # returning conversation's blocks back from the store.
    app = build_serving(smollm2, ServeSettings(kv_disk_bytes=1 << 30), batch=2)
    server = module_live_server(app)
    with httpx.Client(base_url=server.base_url, timeout=600) as client:
        yield client


@pytest.mark.parametrize(
    "turn",
    [openai_turn, anthropic_turn, responses_turn, ollama_turn],
    ids=["openai-chat", "anthropic-messages", "responses", "ollama-chat"],
)
def test_each_turn_after_the_first_is_served_from_the_cache_but_for_what_it_adds(
    client: httpx.Client, turn: Turn
) -> None:
    steps: list[Step] = [("user", FIRST_USER)]
    first_prompt, _ = turn(client, steps)
    assert first_prompt > 600  # the system prompt and the tools' declarations
    shares = []
    for added in LATER_TURNS[: TURNS - 1]:
        steps = steps + added
        prompt, cached = turn(client, steps)
        shares.append(cached / prompt)
    assert min(shares) >= CACHED_SHARE, shares
