"""Malformed requests are 400s in OpenAI's error shape, with the reference's messages."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
PROMPT_REQUIRED = "prompt (a non-empty string, or a non-empty array of token ids) is required"


def assert_openai_400(response: httpx.Response, message: str) -> None:
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code", "param"}
    assert error["type"] == "invalid_request_error"
    assert error["message"] == message


@pytest.mark.parametrize("path", [CHAT, TEXT])
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"null", b'"text"', b""])
async def test_a_body_that_is_not_a_json_object_is_a_400_invalid_json_body(
    client: httpx.AsyncClient, path: str, raw: bytes
) -> None:
    response = await client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_openai_400(response, "invalid JSON body")


@pytest.mark.parametrize("messages", [None, [], "hi", {"role": "user"}])
async def test_missing_or_empty_messages_is_a_400_messages_required(
    client: httpx.AsyncClient, messages: Any
) -> None:
    body = {} if messages is None else {"messages": messages}
    assert_openai_400(await client.post(CHAT, json=body), "messages required")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", "hot", "temperature must be of type float"),
        ("temperature", -1, "temperature must be at least 0"),
        ("top_p", 1.5, "top_p must be at most 1"),
        ("top_k", 2.5, "top_k must be of type int"),
        ("max_tokens", "10", "max_tokens must be of type int"),
        ("max_tokens", 0, "max_tokens must be at least 1"),
        ("max_completion_tokens", True, "max_completion_tokens must be of type int"),
        ("seed", 1.5, "seed must be of type int"),
        ("stream", "yes", "stream must be of type bool"),
        ("stop", 5, "stop must be a string or a list of strings"),
        ("stop", ["a", 1], "stop must be a string or a list of strings"),
        ("logprobs", 1, "logprobs must be of type bool"),
        ("top_logprobs", "2", "top_logprobs must be of type int"),
        ("top_logprobs", -2, "top_logprobs must be at least 0"),
        ("top_logprobs", 12, "top_logprobs must be at most 11"),
        ("logit_bias", {"abc": 1}, "logit_bias must be a dict of int to float"),
        ("logit_bias", {"5": "big"}, "logit_bias must be a dict of int to float"),
        ("logit_bias", [1], "logit_bias must be a dict of int to float"),
        ("repetition_penalty", 0, "repetition_penalty must be greater than 0"),
        ("n", 0, "n must be at least 1"),
        (
            "reasoning_effort",
            "extreme",
            "reasoning_effort must be one of 'none', 'minimal', 'low', 'medium', 'high', 'xhigh'",
        ),
        ("chat_template_kwargs", [], "chat_template_kwargs must be of type dict"),
        (
            "stream_options",
            {"include_usage": 1},
            "stream_options.include_usage must be of type bool",
        ),
        (
            "response_format",
            {"type": "xml"},
            "response_format.type must be one of 'text', 'json_object', 'json_schema'",
        ),
    ],
)
async def test_a_chat_field_of_the_wrong_type_or_range_is_a_400_naming_it(
    client: httpx.AsyncClient, field: str, value: Any, message: str
) -> None:
    response = await client.post(CHAT, json={"messages": USER, field: value})
    assert_openai_400(response, message)
    assert response.json()["error"]["param"] == field.split(".")[0]


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (["hi"], "messages[0] must be of type dict"),
        ([{"content": "hi"}], "messages[0].role must be of type str"),
        (
            [{"role": "robot", "content": "hi"}],
            "messages[0].role must be one of 'system', 'developer', 'user', 'assistant', "
            "'tool', 'function'",
        ),
        (
            [{"role": "user", "content": 5}],
            "messages[0].content must be a string or a list of content parts",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            "messages[0].content[0].text must be of type str",
        ),
        (
            [{"role": "user", "content": [{"type": "hologram"}]}],
            "messages[0].content[0] has an unsupported type 'hologram'",
        ),
    ],
)
async def test_a_malformed_message_is_a_400_naming_where_it_is(
    client: httpx.AsyncClient, messages: list[Any], message: str
) -> None:
    assert_openai_400(await client.post(CHAT, json={"messages": messages}), message)


@pytest.mark.parametrize("prompt", [None, "", [], [[]], [""], [True, 2], [1.5], [[1, "2"]], 5])
async def test_a_completion_prompt_that_is_neither_text_nor_token_ids_is_a_400(
    client: httpx.AsyncClient, prompt: Any
) -> None:
    body = {} if prompt is None else {"prompt": prompt}
    assert_openai_400(await client.post(TEXT, json=body), PROMPT_REQUIRED)


@pytest.mark.parametrize(
    ("value", "message"),
    [("2", "logprobs must be of type int"), (-1, "logprobs must be at least 0"),
     (6, "logprobs must be at most 5")],
)  # fmt: skip
async def test_a_completion_logprobs_out_of_range_is_a_400(
    client: httpx.AsyncClient, value: Any, message: str
) -> None:
    assert_openai_400(await client.post(TEXT, json={"prompt": "hi", "logprobs": value}), message)


async def test_a_refused_request_never_reaches_the_engine(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    await client.post(CHAT, json={"messages": USER, "temperature": "hot"})
    assert engine.submissions == []


async def test_unknown_fields_are_ignored(client: httpx.AsyncClient) -> None:
    body = {"messages": USER, "user": "me", "metadata": {"a": 1}, "parallel_tool_calls": True}
    assert (await client.post(CHAT, json=body)).status_code == 200


async def test_null_fields_count_as_unset(client: httpx.AsyncClient) -> None:
    body = {"messages": USER, "temperature": None, "stop": None, "max_tokens": None}
    assert (await client.post(CHAT, json=body)).status_code == 200


async def test_an_unknown_route_is_a_404_in_openai_error_shape(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/nothing-here")
    assert response.status_code == 404
    assert set(response.json()["error"]) >= {"message", "type", "code", "param"}
