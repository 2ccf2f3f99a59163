"""GGUF encoders written as convert_hf_to_gguf.py writes them (tests/tiny_gguf_encoders.py) from
tiny random models made with transformers' own classes: embeddings equal sentence-transformers'
on the folder they came from (BERT and NomicBERT with mean pooling, XLM-R with CLS pooling), an
XLM-R reranker GGUF scores the reference's logits, and a BERT reranker GGUF (its pooler dropped
by the converter) the projection of the first token, as llama-server computes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_encoders import (
    make_bert_encoder,
    make_nomic_encoder,
    make_xlmr_encoder,
    make_xlmr_reranker,
)
from tiny_gguf_encoders import write_encoder_gguf
from tiny_reranker import make_tiny_reranker

from modelhost.models.loading.encoder_gguf import load_gguf_encoder, load_gguf_reranker

TEXTS = ["the giant panda eats bamboo", "paris is the capital of france", "a"]
QUERY = "what does a giant panda eat?"


@pytest.mark.parametrize(
    "make",
    [make_bert_encoder, make_xlmr_encoder, make_nomic_encoder],
    ids=["bert", "xlm-r", "nomic"],
)
def test_gguf_embeddings_equal_sentence_transformers_on_the_source_folder(
    tmp_path: Path, make: object
) -> None:
    from sentence_transformers import SentenceTransformer

    folder = make(tmp_path / "encoder")  # type: ignore[operator]
    model = load_gguf_encoder(write_encoder_gguf(folder, tmp_path / "encoder.gguf"))
    ours = model.embed([model.token_ids(text) for text in TEXTS])
    expected = torch.tensor(SentenceTransformer(str(folder), device="cpu").encode(TEXTS))
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)


def test_an_xlmr_gguf_reranker_scores_the_reference_logits(tmp_path: Path) -> None:
    folder = make_xlmr_reranker(tmp_path / "reranker")
    model = load_gguf_reranker(write_encoder_gguf(folder, tmp_path / "reranker.gguf"))
    ours = model.score([model.pair(model.tokens(QUERY), model.tokens(d)) for d in TEXTS])
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    reference = transformers.XLMRobertaForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        batch = tokenizer([QUERY] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")
        logits = reference(**batch).logits.squeeze(-1)
    torch.testing.assert_close(torch.tensor(ours), logits, atol=1e-5, rtol=1e-4)


def test_a_bert_gguf_reranker_scores_the_first_token_without_the_dropped_pooler(
    tmp_path: Path,
) -> None:
    folder = make_tiny_reranker(tmp_path / "reranker", max_positions=64, initializer_range=0.3)
    model = load_gguf_reranker(write_encoder_gguf(folder, tmp_path / "reranker.gguf"))
    ours = model.score([model.pair(model.tokens(QUERY), model.tokens(d)) for d in TEXTS])
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    reference = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        batch = tokenizer([QUERY] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")
        first = reference.bert(**batch).last_hidden_state[:, 0]
        logits = reference.classifier(first).squeeze(-1)
    torch.testing.assert_close(torch.tensor(ours), logits, atol=1e-5, rtol=1e-4)
