"""The encoder kinds beyond BERT folders, found by the registry and served by a real server: an
XLM-R reranker folder and a GGUF reranker on /v1/rerank, XLM-R and NomicBERT sentence encoder
folders and a GGUF embedder on /v1/embeddings, /api/embed and /api/embeddings, each answering what
sentence-transformers computes; `dimensions` truncates and renormalises, more than the model has
is OpenAI's 400; the listing marks each kind."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
from live_server import LiveServer
from tiny_encoders import (
    make_bert_encoder,
    make_nomic_encoder,
    make_xlmr_encoder,
    make_xlmr_reranker,
)
from tiny_gguf_encoders import write_encoder_gguf

from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

QUERY = "what does a giant panda eat?"
DOCUMENTS = ["the giant panda eats bamboo", "paris is the capital of france", "pandas"]


def never_generates(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("an encoder loads no generative model")


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
    module_live_server: Callable[..., LiveServer],
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("encoder-world")
    models, sources = root / "models", root / "sources"
    make_xlmr_reranker(models / "xlmr-reranker")
    make_xlmr_encoder(models / "xlmr-encoder")
    make_nomic_encoder(models / "nomic-encoder")
    write_encoder_gguf(make_xlmr_reranker(sources / "reranker"), models / "gguf-reranker.gguf")
    write_encoder_gguf(make_bert_encoder(sources / "encoder"), models / "gguf-encoder.gguf")
    registry = ModelRegistry([models], home=root / "home", hf_hub=root / "hub", embedded=False)
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=10**10,
        source=registry.get,
        load=in_process_loader(never_generates, never_generates),
    )
    router = ModelRouter(host, registry, current="xlmr-encoder")
    server = module_live_server(create_routed_app(router, ServeSettings()))
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield {"client": client, "models": models, "sources": sources}


def scores(served: dict[str, Any], model: str) -> dict[int, float]:
    body = {"model": model, "query": QUERY, "documents": DOCUMENTS}
    response = served["client"].post("/v1/rerank", json=body)
    assert response.status_code == 200, response.text
    return {row["index"]: row["relevance_score"] for row in response.json()["results"]}


def embeddings(served: dict[str, Any], model: str, **body: Any) -> list[list[float]]:
    response = served["client"].post(
        "/v1/embeddings", json={"model": model, "input": DOCUMENTS, **body}
    )
    assert response.status_code == 200, response.text
    return [row["embedding"] for row in response.json()["data"]]


def test_an_xlmr_reranker_folder_scores_as_sentence_transformers_cross_encoder(served) -> None:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(served["models"] / "xlmr-reranker"), device="cpu")
    expected = reference.predict([(QUERY, d) for d in DOCUMENTS])
    got = scores(served, "xlmr-reranker")
    assert [got[i] for i in range(3)] == pytest.approx(expected.tolist(), abs=1e-5)


def test_a_gguf_reranker_scores_the_logits_of_the_model_it_was_converted_from(served) -> None:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(
        str(served["sources"] / "reranker"), device="cpu", activation_fn=torch.nn.Identity()
    )
    expected = reference.predict([(QUERY, d) for d in DOCUMENTS])
    got = scores(served, "gguf-reranker")
    assert [got[i] for i in range(3)] == pytest.approx(expected.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    ("model", "folder"),
    [
        ("xlmr-encoder", ("models", "xlmr-encoder")),
        ("nomic-encoder", ("models", "nomic-encoder")),
        ("gguf-encoder", ("sources", "encoder")),
    ],
)
def test_embeddings_equal_sentence_transformers_on_every_embedding_route(
    served, model: str, folder: tuple[str, str]
) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(served[folder[0]] / folder[1]), device="cpu")
    expected = reference.encode(DOCUMENTS).tolist()
    assert embeddings(served, model) == [pytest.approx(row, abs=1e-5) for row in expected]
    ollama = served["client"].post("/api/embed", json={"model": model, "input": DOCUMENTS})
    assert ollama.json()["embeddings"] == [pytest.approx(row, abs=1e-5) for row in expected]
    legacy = served["client"].post("/api/embeddings", json={"model": model, "prompt": DOCUMENTS[0]})
    assert legacy.json()["embedding"] == pytest.approx(expected[0], abs=1e-5)


def test_dimensions_keep_the_leading_components_renormalised(served) -> None:
    full = torch.tensor(embeddings(served, "gguf-encoder"))
    short = torch.tensor(embeddings(served, "gguf-encoder", dimensions=8))
    expected = torch.nn.functional.normalize(full[:, :8], dim=-1)
    torch.testing.assert_close(short, expected, atol=1e-6, rtol=1e-5)


def test_more_dimensions_than_the_model_has_is_an_openai_400(served) -> None:
    response = served["client"].post(
        "/v1/embeddings", json={"model": "xlmr-encoder", "input": "a", "dimensions": 33}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "dimensions" and "between 1 and 32" in error["message"]


def test_the_listing_marks_rerankers_and_embedders(served) -> None:
    rows = {row["id"]: row for row in served["client"].get("/v1/models").json()["data"]}
    assert rows["xlmr-reranker"]["rerank"] is True and rows["gguf-reranker"]["rerank"] is True
    assert rows["xlmr-encoder"]["embeddings"] is True
    assert rows["gguf-encoder"]["embeddings"] is True
    assert "rerank" not in rows["gguf-encoder"]
