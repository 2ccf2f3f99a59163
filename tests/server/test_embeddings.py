"""POST /v1/embeddings on the embedded all-MiniLM-L6-v2 encoder: OpenAI's shape, batching that
does not change results, formats and dimensions, and the 400s between model kinds."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import httpx
import pytest

from modelhost.inference.embeddings import Encoders

MODEL = "all-minilm-l6-v2"
TEXTS = ["A man is playing a guitar.", "Someone plays an acoustic guitar.", "Stock markets fell."]


async def embed(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/v1/embeddings", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def vectors(result: dict[str, Any]) -> list[list[float]]:
    return [item["embedding"] for item in sorted(result["data"], key=lambda d: d["index"])]


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


async def test_an_embedding_answer_has_openai_list_shape_and_usage(
    client: httpx.AsyncClient,
) -> None:
    result = await embed(client, input=TEXTS)
    assert result["object"] == "list" and result["model"] == MODEL
    assert [(d["object"], d["index"]) for d in result["data"]] == [
        ("embedding", 0),
        ("embedding", 1),
        ("embedding", 2),
    ]
    assert all(len(v) == 384 for v in vectors(result))
    assert result["usage"]["prompt_tokens"] == result["usage"]["total_tokens"] > 3 * 2


async def test_inputs_embed_the_same_one_at_a_time_as_in_one_list(
    client: httpx.AsyncClient,
) -> None:
    together = vectors(await embed(client, input=TEXTS))
    alone = [vectors(await embed(client, input=text))[0] for text in TEXTS]
    for a, b in zip(together, alone, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-6


async def test_a_paraphrase_scores_a_higher_cosine_than_an_unrelated_sentence(
    client: httpx.AsyncClient,
) -> None:
    guitar, paraphrase, markets = vectors(await embed(client, input=TEXTS))
    assert dot(guitar, paraphrase) > dot(guitar, markets) + 0.2


async def test_token_arrays_embed_like_the_text_they_spell(client: httpx.AsyncClient) -> None:
    encoder = (await Encoders().get(MODEL)).model
    ids = encoder.text.tokenizer.encode(TEXTS[0], add_special_tokens=False).ids
    from_ids = vectors(await embed(client, input=[ids]))[0]
    from_text = vectors(await embed(client, input=TEXTS[0]))[0]
    assert max(abs(x - y) for x, y in zip(from_ids, from_text, strict=True)) < 1e-6


async def test_base64_encoding_carries_the_same_little_endian_floats(
    client: httpx.AsyncClient,
) -> None:
    floats = vectors(await embed(client, input=TEXTS[0]))[0]
    encoded = vectors(await embed(client, input=TEXTS[0], encoding_format="base64"))[0]
    decoded = struct.unpack(f"<{len(floats)}f", base64.b64decode(encoded))
    assert max(abs(x - y) for x, y in zip(decoded, floats, strict=True)) < 1e-6


async def test_dimensions_keep_the_leading_components_renormalised(
    client: httpx.AsyncClient,
) -> None:
    full = vectors(await embed(client, input=TEXTS[0]))[0]
    short = vectors(await embed(client, input=TEXTS[0], dimensions=64))[0]
    assert len(short) == 64
    assert math.isclose(math.sqrt(dot(short, short)), 1.0, rel_tol=1e-5)
    norm = math.sqrt(dot(full[:64], full[:64]))
    assert max(abs(x - y / norm) for x, y in zip(short, full[:64], strict=True)) < 1e-5


async def test_a_generative_model_asked_for_embeddings_is_a_400_with_the_reference_message(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/embeddings", json={"model": "x", "input": "hello"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        'served model "scripted-model" is not an embedding model; serve an embedding model '
        "(e.g. Qwen3-Embedding) to use /v1/embeddings"
    )


async def test_an_embedding_model_asked_for_chat_is_a_400(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "embedding model" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": []}, "input"),
        ({"input": [""]}, "input"),
        ({"input": ["ok", 5]}, "input"),
        ({"input": [[1, 2], [99_999_999]]}, "input"),
        ({"encoding_format": "int8"}, "encoding_format"),
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": 385}, "dimensions"),
    ],
)
async def test_malformed_embedding_requests_are_400s_naming_the_field(
    client: httpx.AsyncClient, changes: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "hello", **changes}
    response = await client.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
