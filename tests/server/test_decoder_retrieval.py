"""A decoder embedder and a decoder reranker on a real server, found by the registry from
their files and leased by the host like any model: `/v1/embeddings` (the OpenAI SDK),
`/api/embed`, `dimensions`, `/v1/rerank` with 100 documents in one forward, the listing, and
each refused for what the other does."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from live_server import LiveServer
from tiny_retrieval import (
    make_tiny_qwen3_embedder,
    make_tiny_qwen3_reranker,
    reference_rerank_scores,
    sentence_transformers_vectors,
)

from modelhost.assembly import worker_loader
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry
from modelhost.residency.router import ModelRouter
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.server.app import create_routed_app
from modelhost.server.front.worker_proxy import PID_HEADER
from modelhost.server.settings import ServeSettings

EMBEDDER = "tiny-qwen3-embedding"
RERANKER = "tiny-qwen3-reranker"
TEXTS = ["hello world", "what does a giant panda eat?", "The giant panda eats bamboo."]
QUERY = "what does a giant panda eat?"
DOCUMENTS = [
    "Paris is the capital of France.",
    "The giant panda eats bamboo almost exclusively.",
    "Stock markets fell on Tuesday.",
]


def exact_load(path: str, **kwargs: Any) -> LoadedModel:
    return load_model(path, quantize="none", **kwargs)  # fp32: the references' maths


def never_generates(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("an embedder or reranker gets no generation engine")


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
    module_live_server: Callable[..., LiveServer],
    smollm2: LoadedModel,
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("decoder-retrieval")
    models = root / "models"
    make_tiny_qwen3_embedder(models / EMBEDDER, smollm2)
    make_tiny_qwen3_reranker(models / RERANKER, smollm2)
    registry = ModelRegistry([models], home=root / "home", hf_hub=root / "hub", embedded=False)
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=10**10,
        source=registry.get,
        load=in_process_loader(exact_load, never_generates),
    )
    router = ModelRouter(host, registry, current=EMBEDDER)
    server = module_live_server(create_routed_app(router, ServeSettings()))
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield {"client": client, "sdk": sdk, "host": host, "models": models}


def rerank(served: dict[str, Any], **body: Any) -> httpx.Response:
    payload = {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS, **body}
    response: httpx.Response = served["client"].post("/v1/rerank", json=payload)
    return response


def test_openai_embeddings_equal_sentence_transformers(served: dict[str, Any]) -> None:
    answer = served["sdk"].embeddings.create(model=EMBEDDER, input=TEXTS)
    ours = torch.tensor([item.embedding for item in answer.data])
    expected = sentence_transformers_vectors(served["models"] / EMBEDDER, TEXTS)
    torch.testing.assert_close(ours, expected)
    assert answer.model == EMBEDDER and answer.usage.prompt_tokens > len(TEXTS)


def test_dimensions_keep_the_leading_components_at_unit_length(served: dict[str, Any]) -> None:
    answer = served["sdk"].embeddings.create(model=EMBEDDER, input=TEXTS, dimensions=16)
    ours = torch.tensor([item.embedding for item in answer.data])
    full = sentence_transformers_vectors(served["models"] / EMBEDDER, TEXTS)
    torch.testing.assert_close(ours, F.normalize(full[:, :16], dim=-1))


def test_ollama_embed_gives_the_same_vectors(served: dict[str, Any]) -> None:
    response = served["client"].post("/api/embed", json={"model": EMBEDDER, "input": TEXTS})
    assert response.status_code == 200, response.text
    ours = torch.tensor(response.json()["embeddings"])
    openai_vectors = served["sdk"].embeddings.create(model=EMBEDDER, input=TEXTS).data
    torch.testing.assert_close(ours, torch.tensor([item.embedding for item in openai_vectors]))


def test_rerank_scores_equal_qwen3_rerankers_reference_best_first(
    served: dict[str, Any],
) -> None:
    response = rerank(served, return_documents=True)
    assert response.status_code == 200, response.text
    rows = response.json()["results"]
    expected = reference_rerank_scores(served["models"] / RERANKER, QUERY, DOCUMENTS)
    assert [row["index"] for row in rows] == sorted(range(3), key=lambda i: -expected[i])
    for row in rows:
        assert row["relevance_score"] == pytest.approx(expected[row["index"]], abs=1e-6)
        assert row["document"] == {"text": DOCUMENTS[row["index"]]}


def test_a_hundred_documents_rerank_in_one_forward(served: dict[str, Any]) -> None:
    assert rerank(served).status_code == 200  # loaded and resident
    model = served["host"].peek(RERANKER).stage.model
    before = model.forwards
    documents = [f"document {i} on what pandas eat" for i in range(100)]
    response = rerank(served, documents=documents, top_n=5)
    assert response.status_code == 200, response.text
    assert len(response.json()["results"]) == 5
    assert model.forwards == before + 1


def test_the_listing_marks_the_embedder_and_the_reranker(served: dict[str, Any]) -> None:
    rows = {row["id"]: row for row in served["client"].get("/v1/models").json()["data"]}
    assert rows[RERANKER]["rerank"] is True and "embeddings" not in rows[RERANKER]
    assert rows[EMBEDDER]["embeddings"] is True and "rerank" not in rows[EMBEDDER]


def test_each_is_refused_for_what_the_other_does(served: dict[str, Any]) -> None:
    client = served["client"]
    embed = client.post("/v1/embeddings", json={"model": RERANKER, "input": "hi"})
    assert embed.status_code == 400 and "not an embedding model" in embed.text
    response = rerank(served, model=EMBEDDER)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(f'model "{EMBEDDER}" is not a reranker')
    chat = client.post(
        "/v1/chat/completions",
        json={"model": EMBEDDER, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 400 and "is an embedding model" in chat.text


@pytest.mark.slow
def test_both_answer_from_worker_processes_of_their_own(
    served: dict[str, Any], tmp_path: Path
) -> None:
    models = served["models"]
    registry = ModelRegistry([models], home=tmp_path / "home", hf_hub=tmp_path / "hub")
    settings = ServeSettings()
    host: ResidencyHost[WorkerUnit] = ResidencyHost(
        budget_bytes=10**12, source=registry.get, load=worker_loader(settings, batch=2)
    )
    router = ModelRouter(host, registry, current=EMBEDDER)
    with (
        LiveServer(create_routed_app(router, settings)) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as client,
    ):
        embedded = client.post("/v1/embeddings", json={"model": EMBEDDER, "input": TEXTS})
        assert embedded.status_code == 200, embedded.text
        ours = torch.tensor([item["embedding"] for item in embedded.json()["data"]])
        expected = sentence_transformers_vectors(models / EMBEDDER, TEXTS)
        torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)  # 16-bit weights and KV
        body = {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS}
        ranked = client.post("/v1/rerank", json=body)
        assert ranked.status_code == 200, ranked.text
        scores = {row["index"]: row["relevance_score"] for row in ranked.json()["results"]}
        reference = reference_rerank_scores(models / RERANKER, QUERY, DOCUMENTS)
        assert [scores[i] for i in range(3)] == pytest.approx(reference, abs=1e-3)
        pids = {int(r.headers[PID_HEADER]) for r in (embedded, ranked)}
        assert len(pids) == 2 and os.getpid() not in pids
