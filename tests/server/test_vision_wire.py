"""Images through the official OpenAI, Anthropic and Ollama clients, against a real server over
a vision-language model (SmolLM2 with the fake tower of tests/vision_fake.py): real PNG, JPEG,
WebP and GIF bytes answer, streamed and not; the image decides the answer; a second turn about
the same image is served from the prefix cache; bad images are 400s in each surface's shape."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from PIL import Image
from vision_fake import IMAGE_TOKENS, base64_of, data_url, image_bytes, vision_model

from modelhost.assembly import build_serving
from modelhost.inference.stage import InferenceStage
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow

MODEL = "fake-vlm"
ASK = "Say the word you see:"  # SmolLM2 answers `The word "red" is ...`
MAX_IMAGE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel, module_live_server: Any) -> Any:
    settings = ServeSettings(max_image_bytes=MAX_IMAGE_BYTES)
    return module_live_server(build_serving(vision_model(smollm2), settings, batch=4))


@pytest.fixture
def oai(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


@pytest.fixture
def claude(server: Any) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def openai_user(url: str, text: str = ASK) -> dict[str, Any]:
    parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return {"role": "user", "content": parts}


def ask_openai(client: openai.OpenAI, url: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[openai_user(url)], max_tokens=8, temperature=0, **extra
    )


def stage_of(server: Any) -> InferenceStage:
    stage: InferenceStage = server.app.state.stage
    return stage


# ---------------------------------------------------------------------------------------------
# Answers


def test_openai_chat_reads_the_image_and_the_image_decides_the_answer(
    oai: openai.OpenAI,
) -> None:
    red = ask_openai(oai, data_url(image_bytes("red")))
    blue = ask_openai(oai, data_url(image_bytes("blue", "JPEG"), "image/jpeg"))
    red_text = red.choices[0].message.content
    assert "red" in red_text
    assert "blue" in blue.choices[0].message.content
    assert red.usage.prompt_tokens > IMAGE_TOKENS  # the placeholders are prompt tokens
    again = ask_openai(oai, data_url(image_bytes("red", "WEBP"), "image/webp"))
    assert again.choices[0].message.content == red_text


def test_openai_chat_streams_the_same_answer_as_it_returns(oai: openai.OpenAI) -> None:
    url = data_url(image_bytes("green", "GIF"), "image/gif")
    whole = ask_openai(oai, url).choices[0].message.content
    chunks = list(ask_openai(oai, url, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > IMAGE_TOKENS


def test_a_second_turn_about_the_same_image_reuses_its_kv(oai: openai.OpenAI) -> None:
    url = data_url(image_bytes("yellow"))
    first = ask_openai(oai, url)
    answer = first.choices[0].message.content
    follow = [
        openai_user(url),
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Say it again."},
    ]
    second = oai.chat.completions.create(model=MODEL, messages=follow, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 8  # the first turn's prompt, image included
    other = [openai_user(data_url(image_bytes("black"))), *follow[1:]]
    third = oai.chat.completions.create(model=MODEL, messages=other, max_tokens=4, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens < cached  # not across images


def test_the_responses_api_reads_an_input_image(oai: openai.OpenAI) -> None:
    content = [
        {"type": "input_text", "text": ASK},
        {"type": "input_image", "image_url": data_url(image_bytes("blue")), "detail": "auto"},
    ]
    response = oai.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": content}],  # type: ignore[list-item]
        max_output_tokens=8,
        temperature=0,
    )
    assert "blue" in response.output_text


def anthropic_image(data: bytes, media_type: str) -> dict[str, Any]:
    source = {"type": "base64", "media_type": media_type, "data": base64_of(data)}
    return {"type": "image", "source": source}


def test_anthropic_messages_read_an_image_block_streamed_and_not(
    claude: anthropic.Anthropic,
) -> None:
    content = [
        {"type": "text", "text": ASK},
        anthropic_image(image_bytes("red", "WEBP"), "image/webp"),
    ]
    ask: Any = [{"role": "user", "content": content}]
    message = claude.messages.create(
        model=MODEL, max_tokens=8, messages=ask, extra_body={"temperature": 0}
    )
    with claude.messages.stream(
        model=MODEL, max_tokens=8, messages=ask, extra_body={"temperature": 0}
    ) as stream:
        streamed = "".join(stream.text_stream)
    counted = claude.messages.count_tokens(model=MODEL, messages=ask)
    text = message.content[0].text  # type: ignore[union-attr]
    assert "red" in text
    assert streamed == text
    usage = message.usage  # Anthropic's input_tokens leave out what the cache served
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_ollama_chat_and_generate_read_images_streamed_and_not(server: Any) -> None:
    options = {"temperature": 0, "num_predict": 8}

    def chat(client: ollama.Client, picture: bytes) -> str:
        message = {"role": "user", "content": ASK, "images": [picture]}
        return client.chat(model=MODEL, messages=[message], options=options).message.content or ""

    with ollama.Client(host=server.base_url, timeout=120) as client:
        green = chat(client, image_bytes("green", "PNG"))
        red = chat(client, image_bytes("red", "GIF"))
        parts = list(
            client.generate(
                model=MODEL,
                prompt=ASK,
                images=[image_bytes("green", "PNG")],
                options=options,
                stream=True,
            )
        )
    assert green != red  # Ollama shows a message's images before its text
    assert "".join(part.response for part in parts) == green
    assert parts[-1].prompt_eval_count is not None and parts[-1].prompt_eval_count > IMAGE_TOKENS


# ---------------------------------------------------------------------------------------------
# Refusals, in each surface's shape


def test_a_corrupt_image_is_a_400_naming_the_part(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask_openai(oai, data_url(b"\x89PNG\r\n\x1a\n not really"))
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["message"].startswith("messages[0].content[1]: ")
    assert error["param"] == "messages"


def test_a_remote_image_url_is_refused_not_fetched(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask_openai(oai, "http://127.0.0.1:9/secret.png")
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "image_url_not_allowed"


def test_an_unsupported_format_is_a_400_in_anthropic_shape(server: Any) -> None:
    content = [
        {"type": "text", "text": ASK},
        anthropic_image(image_bytes("red", "BMP"), "image/bmp"),
    ]
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": content}]}
    response = httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=60)
    assert response.status_code == 400
    reply = response.json()
    assert reply["type"] == "error"
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["message"].startswith("messages[0].content[1]: is a BMP image")


def test_an_oversized_image_is_a_400_in_ollama_shape(server: Any) -> None:
    noise = Image.frombytes("RGB", (200, 200), os.urandom(200 * 200 * 3))
    out = io.BytesIO()
    noise.save(out, format="PNG")  # ~120 KB: over the server's 64 KB cap
    body = {"model": MODEL, "prompt": ASK, "images": [base64_of(out.getvalue())], "stream": False}
    response = httpx.post(f"{server.base_url}/api/generate", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"].startswith("image content part is 0.1 MiB")


def test_text_that_types_the_image_marker_beside_an_image_is_a_400(oai: openai.OpenAI) -> None:
    message = openai_user(data_url(image_bytes("red")), text="Compare <image> with")
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=[message], max_tokens=4)  # type: ignore[list-item]
    assert "the prompt shows 2 image(s)" in str(caught.value)


async def test_an_image_on_a_text_only_model_keeps_the_typed_refusal(
    client: httpx.AsyncClient,
) -> None:
    body = {"model": "x", "messages": [openai_user(data_url(image_bytes("red")))]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "model has no vision sidecar"
    content = [anthropic_image(image_bytes("red"), "image/png")]
    body = {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    response = await client.post("/v1/messages", json=body)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"] == "model has no vision sidecar"


def test_no_kv_block_is_held_once_the_answers_are_done(server: Any, oai: openai.OpenAI) -> None:
    ask_openai(oai, data_url(image_bytes("white")))
    manager = stage_of(server).engine.block_manager
    manager.check_invariants()
    assert manager.num_used_blocks == 0
