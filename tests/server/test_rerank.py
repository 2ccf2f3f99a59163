"""POST /v1/rerank (and /rerank) on a real server over a tiny random cross-encoder found by the
registry and leased by the host: best-first results with their indices, `top_n`,
`return_documents`, one forward for 100 documents, the listing, and the refusals in OpenAI's
error shape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import transformers
from live_server import LiveServer
from tiny_reranker import TOKENIZER_FILES, make_tiny_reranker

from modelhost.models.loading.embedded import EMBEDDED_ENCODERS, EMBEDDING_MODEL
from modelhost.models.networks.cross_encoder import load_cross_encoder
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

RERANKER = "tiny-reranker"
ENCODER = "tiny-encoder"
QUERY = "what does a giant panda eat?"
DOCUMENTS = [
    "Paris is the capital of France.",
    "The giant panda eats bamboo almost exclusively.",
    "Stock markets fell on Tuesday.",
    "pandas",
]


def make_tiny_encoder(path: Path) -> None:
    """A sentence encoder beside the reranker: a local model that does not rerank."""
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    transformers.BertModel(config).save_pretrained(path)
    source = EMBEDDED_ENCODERS[EMBEDDING_MODEL]()
    for name in TOKENIZER_FILES:
        (path / name).write_bytes((source / name).read_bytes())


def never_generates(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a reranker loads no generative model")


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
    module_live_server: Callable[..., LiveServer],
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("rerank-world")
    models = root / "models"
    make_tiny_reranker(models / RERANKER, initializer_range=0.3)
    make_tiny_encoder(models / ENCODER)
    registry = ModelRegistry([models], home=root / "home", hf_hub=root / "hub", embedded=False)
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=10**10,
        source=registry.get,
        load=in_process_loader(never_generates, never_generates),
    )
    router = ModelRouter(host, registry, current=RERANKER)
    server = module_live_server(create_routed_app(router, ServeSettings()))
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield {"client": client, "host": host, "path": models / RERANKER}


def rerank(served: dict[str, Any], path: str = "/v1/rerank", **body: Any) -> httpx.Response:
    payload = {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS, **body}
    response: httpx.Response = served["client"].post(path, json=payload)
    return response


def results(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    rows: list[dict[str, Any]] = response.json()["results"]
    return rows


def test_every_document_comes_back_once_best_first_with_its_request_index(served) -> None:
    rows = results(rerank(served))
    assert sorted(row["index"] for row in rows) == [0, 1, 2, 3]
    scores = [row["relevance_score"] for row in rows]
    assert scores == sorted(scores, reverse=True)
    assert all("document" not in row for row in rows)  # return_documents defaults to false


def test_each_score_is_the_cross_encoders_score_of_its_own_document(served) -> None:
    model = load_cross_encoder(served["path"])
    pairs = [model.pair(model.tokens(QUERY), model.tokens(d)) for d in DOCUMENTS]
    expected = model.score(pairs)
    for row in results(rerank(served)):
        assert row["relevance_score"] == pytest.approx(expected[row["index"]], abs=1e-6)


def test_the_answer_names_its_model_and_counts_the_tokens_read(served) -> None:
    answer = rerank(served).json()
    assert answer["model"] == RERANKER and answer["id"].startswith("rerank-")
    usage = answer["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 4 * 3


def test_top_n_keeps_only_the_best_n(served) -> None:
    everything = results(rerank(served))
    assert results(rerank(served, top_n=2)) == everything[:2]
    assert results(rerank(served, top_n=10)) == everything


def test_return_documents_carries_each_documents_text(served) -> None:
    objects = [{"text": d} for d in DOCUMENTS]
    rows = results(rerank(served, documents=objects, return_documents=True))
    assert all(row["document"] == {"text": DOCUMENTS[row["index"]]} for row in rows)


def test_the_root_rerank_path_answers_as_v1_does(served) -> None:
    assert results(rerank(served, path="/rerank")) == results(rerank(served))


def test_a_hundred_documents_rerank_in_one_forward(served) -> None:
    rerank(served)  # loaded and resident
    model = served["host"].peek(RERANKER).stage.model
    before = model.forwards
    documents = [f"document {i} on what pandas eat" for i in range(100)]
    assert len(results(rerank(served, documents=documents))) == 100
    assert model.forwards == before + 1


def test_the_model_listing_marks_the_reranker(served) -> None:
    rows = {row["id"]: row for row in served["client"].get("/v1/models").json()["data"]}
    assert rows[RERANKER]["rerank"] is True
    assert rows[RERANKER]["capabilities"] == {"chat_completions": False, "rerank": True}
    assert "rerank" not in rows[ENCODER]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"query": None}, "query"),
        ({"query": ""}, "query"),
        ({"query": 7}, "query"),
        ({"documents": None}, "documents"),
        ({"documents": []}, "documents"),
        ({"documents": "one string"}, "documents"),
        ({"documents": ["fine", 3]}, "documents"),
        ({"documents": [{"content": "no text"}]}, "documents"),
        ({"top_n": 0}, "top_n"),
        ({"top_n": "2"}, "top_n"),
        ({"return_documents": "yes"}, "return_documents"),
    ],
)
def test_malformed_rerank_requests_are_400s_naming_the_field(served, body, field) -> None:
    response = rerank(served, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404_model_not_found(served) -> None:
    response = rerank(served, model="bge-reranker-v2-m3")
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "bge-reranker-v2-m3" in error["message"]


def test_a_model_that_does_not_rerank_is_a_400_naming_it(served) -> None:
    response = rerank(served, model=ENCODER)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "model"
    assert error["message"].startswith(f'model "{ENCODER}" is not a reranker')


def test_the_reranker_asked_for_embeddings_or_chat_is_a_400(served) -> None:
    client = served["client"]
    embed = client.post("/v1/embeddings", json={"model": RERANKER, "input": "hi"})
    assert embed.status_code == 400 and "not an embedding model" in embed.text
    chat = client.post(
        "/v1/chat/completions",
        json={"model": RERANKER, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 400, chat.text
    assert "is a reranker; it serves /v1/rerank only" in chat.json()["error"]["message"]
