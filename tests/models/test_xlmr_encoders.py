"""XLM-R encoders against sentence-transformers on tiny random models made with transformers'
own classes: embeddings equal `SentenceTransformer.encode` under each pooling mode the folder's
Pooling module names, normalised or not as its modules.json says; rerank scores equal
`CrossEncoder.predict`, long pairs cut as its tokenizer cuts them, in one forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_encoders import make_xlmr_encoder, make_xlmr_reranker

from modelhost.models.networks.bert import load_bert
from modelhost.models.networks.cross_encoder import load_cross_encoder

TEXTS = [
    "the giant panda eats bamboo",
    "paris is the capital of france",
    "bamboo shoots and leaves " * 20,  # longer than the encoder's 48 tokens
    "a",
]
QUERY = "what does a giant panda eat?"


def reference_embeddings(folder: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return torch.tensor(model.encode(texts, batch_size=len(texts)))


@pytest.mark.parametrize(
    ("pooling", "normalize"),
    [("cls", True), ("mean", True), ("max", False), ("lasttoken", True), ("mean", False)],
)
def test_embeddings_equal_sentence_transformers_under_the_folders_own_pooling(
    tmp_path: Path, pooling: str, normalize: bool
) -> None:
    folder = make_xlmr_encoder(tmp_path / "encoder", pooling=pooling, normalize=normalize)
    model = load_bert(folder)
    ours = model.embed([model.token_ids(text) for text in TEXTS])
    expected = reference_embeddings(folder, TEXTS)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
    norms = ours.norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5) == normalize


def test_an_xlmr_text_is_framed_by_s_and_end_s_and_cut_to_the_window(tmp_path: Path) -> None:
    model = load_bert(make_xlmr_encoder(tmp_path / "encoder"))
    ids = model.token_ids(TEXTS[2])
    assert (ids[0], ids[-1], len(ids)) == (0, 2, 48)  # <s> … </s>, sentence_bert_config's 48


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_xlmr_reranker(tmp_path_factory.mktemp("xlmr-reranker"))


def test_xlmr_rerank_scores_equal_sentence_transformers_cross_encoder(reranker: Path) -> None:
    from sentence_transformers import CrossEncoder

    model = load_cross_encoder(reranker)
    ours = model.score([model.pair(model.tokens(QUERY), model.tokens(d)) for d in TEXTS])
    expected = CrossEncoder(str(reranker), device="cpu").predict([(QUERY, d) for d in TEXTS])
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(expected), atol=1e-5, rtol=1e-4)
    assert max(ours) - min(ours) > 1e-3  # the documents are told apart


def test_an_xlmr_pair_is_framed_with_two_separators_between(reranker: Path) -> None:
    model = load_cross_encoder(reranker)
    query, document = model.tokens("panda"), model.tokens("bamboo")
    pair = model.pair(query, document)
    assert pair.input_ids == [0, *query, 2, 2, *document, 2]
    assert set(pair.token_type_ids) == {0}  # one token type


def test_a_hundred_documents_rerank_in_one_forward(reranker: Path) -> None:
    model = load_cross_encoder(reranker)
    query = model.tokens(QUERY)
    documents = [model.tokens(f"document number {i} about bamboo") for i in range(100)]
    pairs = [model.pair(query, document) for document in documents]
    assert len(model.score(pairs)) == 100 and model.forwards == 1
