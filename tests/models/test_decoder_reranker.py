"""A decoder reranker (Qwen3-Reranker's prompt and score) equals Qwen3-Reranker's reference
scoring on transformers' Qwen3ForCausalLM: P(yes) from the logits of "no" and "yes" at the
last position, a query with 100 documents of different lengths in one forward."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_gguf import write_gguf_from_hf
from tiny_retrieval import make_tiny_qwen3_reranker, reference_rerank_scores

from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.models.retrieval.decoder_reranker import (
    DecoderReranker,
    decoder_reranker,
    pair_text,
)

QUERY = "what does a giant panda eat?"
DOCUMENTS = [
    "Paris is the capital of France.",
    "The giant panda eats bamboo almost exclusively.",
    "Stock markets fell on Tuesday.",
    "pandas",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, smollm2: LoadedModel) -> Path:
    path = tmp_path_factory.mktemp("reranker") / "tiny-qwen3-reranker"
    return make_tiny_qwen3_reranker(path, smollm2)


@pytest.fixture(scope="module")
def reranker(folder: Path) -> DecoderReranker:
    return decoder_reranker(load_model(str(folder), quantize="none"), folder.name)


def test_scores_equal_qwen3_rerankers_reference_scoring(
    reranker: DecoderReranker, folder: Path
) -> None:
    scores = reranker.score(reranker.read(QUERY, DOCUMENTS))
    assert scores == pytest.approx(reference_rerank_scores(folder, QUERY, DOCUMENTS), abs=1e-6)
    assert all(0.0 < score < 1.0 for score in scores)


def test_a_prompt_is_the_system_turn_the_pair_and_the_empty_thinking_block(
    reranker: DecoderReranker,
) -> None:
    (prompt,) = reranker.read(QUERY, ["bamboo"])
    text = reranker.tokenizer.decode(prompt.input_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nJudge whether the Document meets")
    assert pair_text(QUERY, "bamboo") in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_hundred_documents_of_different_lengths_are_one_forward(
    reranker: DecoderReranker, folder: Path
) -> None:
    documents = [" ".join(["bamboo"] * (1 + i % 17)) + f" document {i}" for i in range(100)]
    before = reranker.forwards
    scores = reranker.score(reranker.read(QUERY, documents))
    assert reranker.forwards == before + 1
    assert scores == pytest.approx(reference_rerank_scores(folder, QUERY, documents), abs=1e-6)


class NoYesNo:
    """A vocabulary without the tokens "yes" and "no"."""

    def token_to_id(self, token: str) -> int | None:
        return None


def test_a_vocabulary_without_yes_and_no_is_refused(folder: Path) -> None:
    model = load_model(str(folder), quantize="none")
    model.tokenizer.backend = NoYesNo()
    with pytest.raises(ValueError, match="yes and no"):
        decoder_reranker(model, "no-yes")


def test_documents_longer_than_the_native_attention_context_score_as_the_reference(
    reranker: DecoderReranker, folder: Path
) -> None:
    # rows past NATIVE_PROMPT_CONTEXT (256 tokens) attend through SDPA with the step's mask
    documents = [" ".join(["bamboo forest"] * n) for n in (90, 150, 3, 120)]
    scores = reranker.score(reranker.read(QUERY, documents))
    assert scores == pytest.approx(reference_rerank_scores(folder, QUERY, documents), abs=1e-6)


def test_on_the_default_quantized_path_scores_stay_within_a_thousandth(folder: Path) -> None:
    model = decoder_reranker(load_model(str(folder)), folder.name)  # 16-bit weights and KV
    documents = [" ".join(["panda"] * (1 + i % 60)) + f" document {i}" for i in range(30)]
    scores = model.score(model.read(QUERY, documents))
    assert scores == pytest.approx(reference_rerank_scores(folder, QUERY, documents), abs=1e-3)


def test_a_gguf_with_llama_cpps_rank_head_scores_as_the_reference_on_its_folder(
    reranker: DecoderReranker, folder: Path, tmp_path: Path
) -> None:
    head = (reranker.yes_id, reranker.no_id)
    path = write_gguf_from_hf(
        folder, tmp_path / "tiny-qwen3-reranker.gguf", rank_head=head, pre_tokenizer="qwen2"
    )
    model = decoder_reranker(load_model(str(path), quantize="none"), path.stem)
    assert model.head is not None  # scored from cls.output, not the LM head
    scores = model.score(model.read(QUERY, DOCUMENTS))
    assert scores == pytest.approx(reference_rerank_scores(folder, QUERY, DOCUMENTS), abs=1e-6)
