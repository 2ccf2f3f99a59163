"""Property-based bodies for every POST route, against the app in-process over the scripted
engine: the only answers are 2xx or 4xx refusals in the route's error shape (and the typed
501 placement refusal), never a 500, and never a hang."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted_engine import ScriptedEngine, scripted_model

from modelhost.assembly import build_app
from modelhost.server.settings import ServeSettings

ANSWER_TIMEOUT_S = 15.0
REFUSALS = {400, 404, 409, 413, 415, 422, 429}
SKIPPED = ("/api/jobs",)  # job submissions start real work; the jobs tests own that surface


def post_routes() -> list[str]:
    app = build_app(ScriptedEngine(), scripted_model(), ServeSettings())
    return sorted(
        route.path
        for route in app.routes
        if "POST" in (getattr(route, "methods", None) or ())
        and "{" not in route.path
        and not route.path.startswith(SKIPPED)
    )


# ---------------------------------------------------------------------------------------------
# Bodies

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=24)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=16,
)
numbers = st.integers(min_value=-10, max_value=10**9) | st.floats(allow_nan=True) | values
PART_TYPES = ["text", "input_text", "image_url", "image", "input_image", "input_audio", "file",
              "video_url", "tool_use", "tool_result", "thinking", "refusal", "bogus"]  # fmt: skip
part = st.fixed_dictionaries(
    {"type": st.sampled_from(PART_TYPES)},
    optional={
        "text": st.text(max_size=30) | values,
        "image_url": st.sampled_from(["data:image/png;base64,AAAA", "http://x/y.png"]) | values,
        "source": values,
        "input_audio": values,
        "content": values,
        "id": st.text(max_size=8),
        "name": st.text(max_size=8),
        "input": values,
    },
)
ROLES = ["system", "developer", "user", "assistant", "tool", "function", "bogus"]
message = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES) | values},
    optional={
        "content": st.text(max_size=40) | st.lists(part, max_size=3) | values,
        "name": st.text(max_size=8),
        "tool_calls": values,
        "tool_call_id": st.text(max_size=8),
        "type": st.sampled_from(["message", "function_call", "function_call_output", "bogus"]),
        "images": st.lists(st.text(max_size=8), max_size=2) | values,  # Ollama's
        "thinking": values,
        "tool_name": values,
    },
)
tool = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "bogus"])},
    optional={
        "function": st.fixed_dictionaries(
            {"name": st.text(max_size=8)}, optional={"parameters": values}
        ),
        "name": st.text(max_size=8),
        "input_schema": values,
        "parameters": values,
    },
)
response_format = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "regex", "bogus"])},
    optional={
        "json_schema": st.fixed_dictionaries(
            {"name": st.text(max_size=8)}, optional={"schema": values}
        ),
        "schema": values,
    },
)
question = st.fixed_dictionaries(
    {"type": st.sampled_from(["predicate", "choice", "score", "bogus"])},
    optional={
        "id": st.text(max_size=8),
        "question": st.text(max_size=20),
        "choices": st.lists(st.text(max_size=8), max_size=4) | values,
        "options": values,
    },
)
OPTIONS = ["temperature", "top_p", "top_k", "min_p", "num_predict", "seed", "stop",
           "repeat_penalty", "num_ctx", "mirostat", "num_gpu"]  # fmt: skip
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["scripted-model", "", "../../etc/passwd", "all-minilm-l6-v2"])
    | values,
    "messages": st.lists(message, max_size=4) | values,
    "prompt": st.text(max_size=40) | st.lists(st.text(max_size=10), max_size=3) | values,
    "input": st.text(max_size=40)
    | st.lists(message, max_size=3)
    | st.lists(st.integers(0, 300), max_size=8)
    | values,
    "instructions": st.text(max_size=20) | values,
    "system": st.text(max_size=20) | st.lists(part, max_size=2) | values,
    "max_tokens": numbers,
    "max_completion_tokens": numbers,
    "max_output_tokens": numbers,
    "stream": st.booleans() | values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": values}) | values,
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "min_p": numbers,
    "n": numbers,
    "seed": numbers,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=5) | values,
    "stop_sequences": st.lists(st.text(max_size=5), max_size=5) | values,
    "logprobs": st.booleans() | numbers,
    "top_logprobs": numbers,
    "logit_bias": st.dictionaries(st.text(max_size=4), numbers, max_size=3) | values,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "tools": st.lists(tool, max_size=2) | values,
    "tool_choice": st.sampled_from(["auto", "none", "required", "any"]) | values,
    "response_format": response_format | values,
    "text": st.fixed_dictionaries({}, optional={"format": response_format}) | values,
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"])})
    | values,
    "reasoning": values,
    "previous_response_id": st.text(max_size=12) | values,
    "store": values,
    "echo": values,
    "suffix": values,
    # Ollama's
    "options": st.dictionaries(st.sampled_from(OPTIONS), numbers, max_size=4) | values,
    "format": st.sampled_from(["json", "", "yaml"]) | st.just({"type": "object"}) | values,
    "keep_alive": st.sampled_from(["5m", "0", "-1", "soon", "1h30m", "1e400"]) | numbers,
    "think": st.sampled_from([True, False, "high", "bogus"]) | values,
    "raw": values,
    "template": values,
    "images": st.lists(st.text(max_size=8), max_size=2) | values,
    "context": values,
    "questions": st.lists(question, max_size=3) | values,
    "state": st.text(max_size=20) | values,
    "encoding_format": st.sampled_from(["float", "base64", "bogus"]) | values,
    "dimensions": numbers,
    "metadata": values,
    "user": values,
    "parallel_tool_calls": values,
}  # fmt: skip
shaped = st.fixed_dictionaries({}, optional=FIELDS)
HI = [{"role": "user", "content": "hi"}]
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "scripted-model", "messages": HI},
    "/v1/completions": {"model": "scripted-model", "prompt": "hi"},
    "/v1/messages": {"model": "scripted-model", "max_tokens": 8, "messages": HI},
    "/v1/messages/count_tokens": {"model": "scripted-model", "messages": HI},
    "/v1/responses": {"model": "scripted-model", "input": "hi"},
    "/v1/embeddings": {"model": "scripted-model", "input": "hi"},
    "/v1/decisions": {
        "input": "hi",
        "questions": [{"type": "predicate", "name": "yes", "instructions": "is it?"}],
    },
    "/api/chat": {"model": "scripted-model", "messages": HI},
    "/api/generate": {"model": "scripted-model", "prompt": "hi"},
    "/api/embed": {"model": "scripted-model", "input": "hi"},
    "/api/embeddings": {"model": "scripted-model", "prompt": "hi"},
    "/api/show": {"model": "scripted-model"},
    "/v1/systemone": {
        "state": "hi",
        "questions": {"ok": {"type": "noul", "instructions": "is it ok?"}},
    },
}


def bodies_for(path: str) -> st.SearchStrategy[bytes]:
    """Mostly a valid body with a few fields changed, sometimes any JSON or any bytes."""
    valid = VALID.get(path, {})
    changed = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=3).flatmap(
        lambda keys: st.fixed_dictionaries({key: FIELDS[key] for key in keys})
    )
    mutated = changed.map(lambda fields: {**valid, **fields})
    return st.one_of(
        mutated.map(dumps),
        mutated.map(dumps),
        shaped.map(dumps),
        values.map(dumps),
        st.binary(max_size=40),
    )


def dumps(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as Python writes them (json reads them)


# ---------------------------------------------------------------------------------------------
# The property


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def client(loop: asyncio.AbstractEventLoop) -> Iterator[httpx.AsyncClient]:
    app = build_app(ScriptedEngine(), scripted_model(), ServeSettings())
    transport = httpx.ASGITransport(app=app)
    client = httpx.AsyncClient(transport=transport, base_url="http://testserver")
    yield client
    loop.run_until_complete(client.aclose())


def check_error_shape(path: str, status: int, answer: Any) -> None:
    if path.startswith("/api/"):  # Ollama's: {"error": "..."}
        assert isinstance(answer["error"], str), answer
        return
    if path.startswith("/v1/messages"):
        assert answer["type"] == "error", answer
        error = answer["error"]
    else:
        error = answer["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str), answer


def check_stream(text: str) -> None:
    for line in text.splitlines():
        if line.startswith("data: {"):
            frame = json.loads(line[len("data: ") :])
            error = frame.get("error") if isinstance(frame, dict) else None
            if isinstance(error, dict):
                assert error.get("type") not in ("server_error", "api_error"), frame


async def answer(client: httpx.AsyncClient, path: str, body: bytes) -> None:
    headers = {"content-type": "application/json"}
    response = await asyncio.wait_for(
        client.post(path, content=body, headers=headers), ANSWER_TIMEOUT_S
    )
    status = response.status_code
    described = f"{status} for {body[:300]!r}: {response.text[:300]}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert status == 200, described
        check_stream(response.text)
        return
    if response.headers.get("content-type", "").startswith("application/x-ndjson"):
        assert status == 200, described
        for line in response.text.splitlines():
            assert isinstance(json.loads(line), dict), described  # every line one object
        return
    if 200 <= status < 300:
        return
    if status == 501 and path.startswith("/api/"):
        assert isinstance(response.json()["error"], str), described
    elif status == 501:
        assert response.json()["error"]["code"] == "unsupported_execution", described
    else:
        assert status in REFUSALS, described
    check_error_shape(path, status, response.json())


@pytest.mark.parametrize("path", post_routes())
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same bodies every run: a failure here is a regression, not luck
    database=None,
)
@given(data=st.data())
def test_any_body_gets_a_2xx_or_a_shaped_refusal_never_a_500_or_a_hang(
    loop: asyncio.AbstractEventLoop, client: httpx.AsyncClient, path: str, data: st.DataObject
) -> None:
    body = data.draw(bodies_for(path), label="body")
    loop.run_until_complete(answer(client, path, body))


def test_the_fuzzed_routes_cover_the_inference_surfaces() -> None:
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/decisions",
        "/v1/systemone",
        "/api/chat",
        "/api/generate",
        "/api/embed",
        "/api/embeddings",
        "/api/show",
    } <= set(post_routes())
