"""Tiny random decoder embedders and rerankers made with transformers' own classes and a real
tokenizer (SmolLM2's), and their references: sentence-transformers' `SentenceTransformer` for
the embedder (a folder it saved itself: modules.json, 1_Pooling with last-token pooling,
Normalize), transformers' `Qwen3ForCausalLM` scored the way Qwen3-Reranker's model card scores
(softmax over the logits of "no" and "yes" at the last position, left padding)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from tiny_models import SHAPE, make_tiny_checkpoint
from tokenizers import Tokenizer as TokenizerBackend
from tokenizers.processors import TemplateProcessing

from modelhost.models.loaded import LoadedModel
from modelhost.models.retrieval.decoder_reranker import PREFIX, SUFFIX, pair_text

EOS = "<|endoftext|>"  # what Qwen3-Embedding's tokenizer appends to every text; id 0 here


def make_tiny_qwen3_embedder(
    directory: Path,
    donor: LoadedModel,
    *,
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    max_seq_length: int | None = None,
) -> Path:
    """A Qwen3Model (random weights, seeded) saved by sentence-transformers with last-token
    pooling (and Normalize), its tokenizer appending <|endoftext|> as Qwen3-Embedding's does."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen3Config(
        vocab_size=donor.tokenizer.vocab_size, tie_word_embeddings=True, **SHAPE
    )
    torch.manual_seed(0)
    model = transformers.Qwen3Model(config).eval()
    with torch.no_grad():  # random norms, so the final norm's weight counts
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    backend = TokenizerBackend.from_str(donor.tokenizer.backend.to_str())
    eos_id = backend.token_to_id(EOS)
    backend.post_processor = TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, eos_id)]
    )
    backend.save(str(directory / "tokenizer.json"))
    settings = {"eos_token": EOS, "pad_token": EOS, "padding_side": "left"}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modules: list[Any] = [
            Transformer(str(directory), max_seq_length=max_seq_length),
            Pooling(config.hidden_size, pooling_mode="lasttoken"),
        ]
        if normalize:
            modules.append(Normalize())
        encoder = SentenceTransformer(
            modules=modules,
            device="cpu",
            prompts=prompts,
            default_prompt_name=default_prompt_name,
        )
        encoder.save(str(directory))
    return as_transformers_reads(directory)


def as_transformers_reads(directory: Path) -> Path:
    """tokenizer.json rewritten as transformers reads it for a qwen3 folder: its Qwen2
    tokenizer class replaces SmolLM2's pre-tokenizer with Qwen's own (a real Qwen3 folder's
    file has that one already)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    tokenizer.backend_tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def sentence_transformers_vectors(
    directory: Path, texts: Sequence[str], **encode: Any
) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoder = SentenceTransformer(str(directory), device="cpu")
        vectors = encoder.encode(list(texts), convert_to_tensor=True, batch_size=64, **encode)
    return vectors.float()


def make_tiny_qwen3_reranker(directory: Path, donor: LoadedModel) -> Path:
    """A Qwen3ForCausalLM (random weights, seeded) with a pad token for the reference's left
    padding; a folder whose name says reranker."""
    make_tiny_checkpoint(directory, "qwen3", donor)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings.update(pad_token=EOS, padding_side="left")
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return as_transformers_reads(directory)


def reference_rerank_scores(directory: Path, query: str, documents: Sequence[str]) -> list[float]:
    """Qwen3-Reranker's model card's scoring, on transformers' Qwen3ForCausalLM."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), padding_side="left")
    model = transformers.Qwen3ForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prefix = tokenizer.encode(PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(SUFFIX, add_special_tokens=False)
    budget = 8192 - len(prefix) - len(suffix)
    pairs = [pair_text(query, document) for document in documents]
    inputs = tokenizer(
        pairs,
        padding=False,
        truncation="longest_first",
        return_attention_mask=False,
        max_length=budget,
    )
    inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
    padded = tokenizer.pad(inputs, padding=True, return_tensors="pt")
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    with torch.no_grad():
        logits = model(**padded).logits[:, -1, :]
    odds = torch.stack([logits[:, no], logits[:, yes]], dim=1)
    return torch.log_softmax(odds, dim=1)[:, 1].exp().tolist()
