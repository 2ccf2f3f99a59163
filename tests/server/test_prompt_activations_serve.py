"""`modelhost serve --prompt-activations auto|8|16|bf16`: the flag, its way to a worker, and a
server that honours it, seen through the official OpenAI SDK."""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import openai
import pytest

from modelhost import serve_config
from modelhost.assembly import build_serving
from modelhost.cli import serve_args as cli_serve_args
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.quant import amx_in_hardware
from modelhost.serve_config import WorkerConfig
from modelhost.server.settings import ServeSettings

MODEL = "smollm2-135m-instruct"
# A prompt of several hundred tokens: its rows before the last run at 8 bits on one server.
ASK: list[Any] = [
    {"role": "system", "content": "You are a careful assistant who answers briefly. " * 30},
    {"role": "user", "content": "Name three colours."},
]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="modelhost")
    cli_serve_args.add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_prompt_activations_are_auto_unless_the_flag_says_8_16_or_bf16() -> None:
    assert serve_config.settings_from_args(parse()).prompt_activations == "auto"
    settings = serve_config.settings_from_args(parse("--prompt-activations", "8"))
    assert settings.prompt_activations == 8
    settings = serve_config.settings_from_args(parse("--prompt-activations", "16"))
    assert settings.prompt_activations == 16
    settings = serve_config.settings_from_args(parse("--prompt-activations", "bf16"))
    assert settings.prompt_activations == "bf16"


def test_prompt_activations_other_than_8_or_16_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        parse("--prompt-activations", "4")
    assert "--prompt-activations" in capsys.readouterr().err


def test_a_worker_is_told_the_prompt_activations() -> None:
    config = WorkerConfig(ServeSettings(prompt_activations=8))
    assert WorkerConfig.from_json(config.to_json()).settings.prompt_activations == 8
    auto = WorkerConfig(ServeSettings())
    assert WorkerConfig.from_json(auto.to_json()).settings.prompt_activations == "auto"


def ask(server: Any, **extra: Any) -> Any:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=16, **extra
    )


def test_a_server_with_8_bit_prompts_answers_with_the_same_usage_and_its_cache_agrees(
    smollm2: LoadedModel, module_live_server: Any
) -> None:
    fine = module_live_server(build_serving(smollm2, ServeSettings(), batch=2))
    coarse = module_live_server(
        build_serving(smollm2, ServeSettings(prompt_activations=8), batch=2)
    )
    expected, first, again = ask(fine), ask(coarse), ask(coarse)
    assert first.usage is not None and expected.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens == expected.usage.prompt_tokens > 256
    assert first.usage.completion_tokens == expected.usage.completion_tokens == 16
    assert first.choices[0].message.content
    # The repeat comes from the prefix cache, which holds the same 8-bit prompt's blocks.
    details = again.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    # /stats says what each server's prompts take: auto gives SmolLM2 bf16 on a CPU with AMX,
    # else 16 bits.
    auto = "bf16" if amx_in_hardware() else 16
    assert httpx.get(f"{fine.base_url}/stats").json()["batch"]["prompt_activations"] == auto
    assert httpx.get(f"{coarse.base_url}/stats").json()["batch"]["prompt_activations"] == 8
