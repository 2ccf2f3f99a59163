"""A decoder embedder (Qwen3-Embedding's shape: last-token pooling, unit vectors) equals
sentence-transformers on a tiny random Qwen3 folder it saved itself: many texts of different
lengths in one forward, the default prompt, the cut to max_seq_length, a folder without
Normalize."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_gguf import write_gguf_from_hf
from tiny_retrieval import EOS, make_tiny_qwen3_embedder, sentence_transformers_vectors

from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.models.retrieval.decoder_embedder import DecoderEmbedder, decoder_embedder

TEXTS = ["hello world", "what does a giant panda eat?", "a", "The giant panda eats bamboo."]
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"


def embedder(path: Path) -> DecoderEmbedder:
    return decoder_embedder(load_model(str(path), quantize="none"), path.name)


def our_vectors(model: DecoderEmbedder, texts: list[str]) -> torch.Tensor:
    return model.embed([model.token_ids(text) for text in texts])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, smollm2: LoadedModel) -> Path:
    path = tmp_path_factory.mktemp("embedder") / "tiny-qwen3-embedding"
    return make_tiny_qwen3_embedder(path, smollm2)


def test_decoder_embedder_vectors_equal_sentence_transformers(folder: Path) -> None:
    ours = our_vectors(embedder(folder), TEXTS)
    torch.testing.assert_close(ours, sentence_transformers_vectors(folder, TEXTS))
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)))


def test_every_text_ends_with_the_token_its_tokenizer_appends(folder: Path) -> None:
    model = embedder(folder)
    eos = model.tokenizer.token_to_id(EOS)
    assert [model.token_ids(text)[-1] for text in TEXTS] == [eos] * len(TEXTS)
    assert model.framed([5, 6, 7]) == [5, 6, 7, eos]


def test_a_hundred_texts_of_different_lengths_are_one_forward(folder: Path) -> None:
    texts = [" ".join(["bamboo"] * (1 + i % 23)) + f" number {i}" for i in range(100)]
    model = embedder(folder)
    ours = our_vectors(model, texts)
    assert model.forwards == 1
    torch.testing.assert_close(ours, sentence_transformers_vectors(folder, texts))


def test_the_default_prompt_goes_before_every_text(tmp_path: Path, smollm2: LoadedModel) -> None:
    path = make_tiny_qwen3_embedder(
        tmp_path / "prompted",
        smollm2,
        prompts={"query": QUERY_PROMPT, "document": ""},
        default_prompt_name="query",
    )
    ours = our_vectors(embedder(path), TEXTS)
    torch.testing.assert_close(ours, sentence_transformers_vectors(path, TEXTS))
    unprompted = sentence_transformers_vectors(path, TEXTS, prompt="")
    assert not torch.allclose(ours, unprompted)


def test_a_text_longer_than_max_seq_length_is_cut_keeping_its_last_token(
    tmp_path: Path, smollm2: LoadedModel
) -> None:
    path = make_tiny_qwen3_embedder(tmp_path / "short", smollm2, max_seq_length=8)
    model = embedder(path)
    long_text = "the giant panda eats bamboo almost exclusively, and sleeps a lot"
    assert len(model.token_ids(long_text)) == 8
    ours = our_vectors(model, [long_text, "a"])
    torch.testing.assert_close(ours, sentence_transformers_vectors(path, [long_text, "a"]))


def test_a_folder_without_normalize_gives_the_raw_last_hidden_state(
    tmp_path: Path, smollm2: LoadedModel
) -> None:
    path = make_tiny_qwen3_embedder(tmp_path / "raw", smollm2, normalize=False)
    ours = our_vectors(embedder(path), TEXTS)
    torch.testing.assert_close(ours, sentence_transformers_vectors(path, TEXTS))
    assert not torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)))


def test_a_gguf_with_last_token_pooling_equals_sentence_transformers_on_its_folder(
    folder: Path, tmp_path: Path
) -> None:
    eos = embedder(folder).tokenizer.token_to_id(EOS)
    path = write_gguf_from_hf(
        folder, tmp_path / "tiny-qwen3-embedding.gguf", pooling_type=3, appended_eos=eos
    )
    model = embedder(path)
    assert [model.token_ids(text)[-1] for text in TEXTS] == [eos] * len(TEXTS)
    torch.testing.assert_close(
        our_vectors(model, TEXTS), sentence_transformers_vectors(folder, TEXTS)
    )


def test_on_the_default_quantized_path_vectors_stay_within_a_thousandth(folder: Path) -> None:
    model = decoder_embedder(load_model(str(folder)), folder.name)  # 16-bit weights and KV
    texts = [" ".join(["bamboo"] * (1 + i % 40)) + f" number {i}" for i in range(30)]
    expected = sentence_transformers_vectors(folder, texts)
    torch.testing.assert_close(our_vectors(model, texts), expected, atol=1e-3, rtol=0)
