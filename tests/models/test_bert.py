"""The BERT sentence encoder (all-MiniLM-L6-v2): parity with transformers, batch invariance,
and embeddings that put paraphrases closer than unrelated sentences."""

from __future__ import annotations

import pytest
import torch

from modelhost.models.loading.embedded import EMBEDDING_MODEL, encoder_path
from modelhost.models.networks.bert import EmbeddingModel, cosine, load_bert

SENTENCES = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Hi",
]


@pytest.fixture(scope="module")
def encoder() -> EmbeddingModel:
    path = encoder_path(EMBEDDING_MODEL)
    assert path is not None
    return load_bert(path, EMBEDDING_MODEL)


def embed_texts(encoder: EmbeddingModel, texts: list[str]) -> torch.Tensor:
    return encoder.embed([encoder.token_ids(text) for text in texts])


def test_embeddings_match_transformers_bert_mean_pooled_and_normalised(
    encoder: EmbeddingModel,
) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.BertModel.from_pretrained(str(encoder.path), add_pooling_layer=False)
    reference.eval()
    ids = [encoder.token_ids(text) for text in SENTENCES]
    length = max(map(len, ids))
    input_ids = torch.tensor([row + [0] * (length - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in ids])
    with torch.inference_mode():
        hidden = reference(input_ids=input_ids, attention_mask=mask).last_hidden_state
    weights = mask.unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)
    torch.testing.assert_close(encoder.embed(ids), expected, atol=1e-5, rtol=1e-4)


def test_an_input_embeds_the_same_alone_as_in_a_padded_batch(encoder: EmbeddingModel) -> None:
    batched = embed_texts(encoder, SENTENCES)
    alone = torch.cat([embed_texts(encoder, [text]) for text in SENTENCES])
    torch.testing.assert_close(batched, alone, atol=1e-6, rtol=1e-5)


def test_embeddings_are_unit_vectors_of_the_model_width(encoder: EmbeddingModel) -> None:
    vectors = embed_texts(encoder, SENTENCES)
    assert vectors.shape == (3, 384)
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(3))


def test_a_paraphrase_is_closer_than_an_unrelated_sentence(encoder: EmbeddingModel) -> None:
    a, paraphrase, unrelated = embed_texts(
        encoder,
        [
            "How do I reset my password?",
            "What are the steps to change my login password?",
            "The weather in Lisbon is sunny today.",
        ],
    )
    assert cosine(a, paraphrase) > cosine(a, unrelated) + 0.2


def test_input_longer_than_the_encoder_window_is_cut_to_it(encoder: EmbeddingModel) -> None:
    ids = encoder.token_ids("word " * 1000)
    assert len(ids) == encoder.config.max_seq_length
    assert (ids[0], ids[-1]) == (101, 102)  # [CLS] … [SEP]
