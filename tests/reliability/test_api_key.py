"""`--api-key`: the official SDKs pass with the key, get a 401 in their protocol's shape without
it, and /health stays open."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from reliability_support import HELLO, AppFactory, ClientFactory

from modelhost import serve_config
from modelhost.cli import serve_args as cli_serve_args

KEY = "sk-local-test-key"
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
Live = Callable[..., Any]


def openai_sdk(server: Any, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=10)


def anthropic_sdk(server: Any, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=10)


def test_the_openai_sdk_with_the_right_key_gets_its_answer(
    make_app: AppFactory, live_server: Live
) -> None:
    server = live_server(make_app(api_key=KEY))
    with openai_sdk(server, KEY) as client:
        answer = client.chat.completions.create(model="scripted-model", messages=MESSAGES)
    assert answer.choices[0].message.content == "Hello, world!"


def test_the_openai_sdk_with_a_wrong_key_gets_an_openai_shaped_401(
    make_app: AppFactory, live_server: Live
) -> None:
    server = live_server(make_app(api_key=KEY))
    client = openai_sdk(server, "wrong-key")
    with client, pytest.raises(openai.AuthenticationError) as caught:
        client.chat.completions.create(model="scripted-model", messages=MESSAGES)
    assert caught.value.status_code == 401
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")


async def test_a_chat_request_without_a_key_gets_an_openai_shaped_401(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(api_key=KEY))
    response = await client.post("/v1/chat/completions", json=HELLO)
    assert response.status_code == 401
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "missing_api_key")


async def test_an_anthropic_request_without_a_key_gets_an_anthropic_shaped_401(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(api_key=KEY))
    body = {"model": "m", "max_tokens": 8, "messages": MESSAGES}
    response = await client.post("/v1/messages", json=body)
    assert response.status_code == 401
    answer = response.json()
    assert answer["type"] == "error"
    assert answer["error"]["type"] == "authentication_error"


def test_the_anthropic_sdk_with_the_right_key_gets_its_answer(
    make_app: AppFactory, live_server: Live
) -> None:
    server = live_server(make_app(api_key=KEY))
    with anthropic_sdk(server, KEY) as client:
        message = client.messages.create(model="scripted-model", max_tokens=16, messages=MESSAGES)
    assert message.content[0].type == "text"


def test_the_anthropic_sdk_with_a_wrong_key_gets_an_anthropic_shaped_401(
    make_app: AppFactory, live_server: Live
) -> None:
    server = live_server(make_app(api_key=KEY))
    client = anthropic_sdk(server, "wrong-key")
    with client, pytest.raises(anthropic.AuthenticationError) as caught:
        client.messages.create(model="scripted-model", max_tokens=16, messages=MESSAGES)
    assert caught.value.status_code == 401
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"


async def test_the_responses_surface_answers_a_missing_key_in_its_own_shape(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(api_key=KEY))
    response = await client.post("/v1/responses", json={"model": "m", "input": "hi"})
    assert response.status_code == 401
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == "missing_api_key"
    assert response.headers["www-authenticate"] == "Bearer"


async def test_health_stays_open_without_a_key(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(api_key=KEY))
    assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/stats", "/metrics", "/v1"])
async def test_every_other_route_needs_the_key(
    make_app: AppFactory, client_of: ClientFactory, path: str
) -> None:
    client = client_of(make_app(api_key=KEY))
    assert (await client.get(path)).status_code == 401
    assert (await client.get(path, headers={"x-api-key": KEY})).status_code == 200


async def test_a_bearer_key_in_any_letter_case_of_the_scheme_passes(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(api_key=KEY))
    response = await client.post(
        "/v1/chat/completions", json=HELLO, headers={"authorization": f"bearer {KEY}"}
    )
    assert response.status_code == 200


async def test_keys_are_compared_in_constant_time(
    make_app: AppFactory, client_of: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hmac

    from modelhost.server.edge import access

    compared: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(access.hmac, "compare_digest", compare_digest)
    client = client_of(make_app(api_key=KEY))
    await client.get("/v1/models", headers={"x-api-key": "nope"})
    assert (b"nope", KEY.encode()) in compared


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="modelhost")
    cli_serve_args.add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_the_key_comes_from_the_flag_then_the_file_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("MODELHOST_API_KEY", "from-env")
    assert serve_config.settings_from_args(parse("--api-key", "from-flag")).api_key == "from-flag"
    settings = serve_config.settings_from_args(parse("--api-key-file", str(key_file)))
    assert settings.api_key == "from-file"
    assert serve_config.settings_from_args(parse()).api_key == "from-env"
    monkeypatch.delenv("MODELHOST_API_KEY")
    assert serve_config.settings_from_args(parse()).api_key is None


def test_an_unreadable_key_file_stops_serve_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="api-key-file"):
        serve_config.settings_from_args(parse("--api-key-file", str(tmp_path / "missing")))


def test_the_key_never_shows_in_the_settings_repr() -> None:
    settings = serve_config.settings_from_args(parse("--api-key", "hunter2"))
    assert "hunter2" not in repr(settings)


def test_the_edge_flags_become_settings() -> None:
    args = parse(
        *("--cors-origin", "http://localhost:3000", "--cors-origin", "http://localhost:5173"),
        *("--max-body-mb", "2", "--log-format", "json", "--host", "0.0.0.0"),
    )
    settings = serve_config.settings_from_args(args)
    assert settings.cors_origins == ("http://localhost:3000", "http://localhost:5173")
    assert settings.max_body_bytes == 2 * 1024 * 1024
    assert (settings.log_format, settings.host) == ("json", "0.0.0.0")


def test_serve_defaults_to_no_key_a_32_mib_body_cap_and_text_logs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MODELHOST_API_KEY", raising=False)
    settings = serve_config.settings_from_args(parse())
    assert (settings.api_key, settings.cors_origins) == (None, ())
    assert settings.max_body_bytes == 32 * 1024 * 1024
    assert (settings.log_format, settings.host) == ("text", "127.0.0.1")
