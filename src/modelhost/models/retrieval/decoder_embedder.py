"""Decoder embedders (Qwen3-Embedding): the final hidden state at a text's last token, unit
length where the model's files say so, as sentence-transformers' `SentenceTransformer.encode`
computes it.

A text is read as sentence-transformers reads it: the default prompt its
config_sentence_transformers.json names (if any) before it, the tokenizer's own special tokens
around it (Qwen3-Embedding's tokenizer appends <|endoftext|>, the token that is pooled), cut to
`max_seq_length` with those special tokens kept. A GGUF's vectors are unit length, as
llama-server returns them, and its texts end with the EOS its header says to append.
Token-id inputs get the same special tokens around them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F

from modelhost.models.config import ModelConfig
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.gguf_header import GGUFFile
from modelhost.models.retrieval.retrieval_files import sentence_files
from modelhost.models.retrieval.whole_prompts import groups, last_hidden


@dataclass(slots=True)
class DecoderEmbedder:
    """A decoder serving /v1/embeddings; the interface EncoderStage reads (id, config,
    dimensions, weights_bytes, token_ids, framed, embed)."""

    id: str
    model: LoadedModel
    tokenizer: tokenizers.Tokenizer
    prompt: str  # prepended to every text (the default prompt; "" when none)
    normalize: bool
    prefix: tuple[int, ...]  # the special tokens the tokenizer puts around a text
    suffix: tuple[int, ...]
    max_length: int
    forwards: int = 0  # batched forwards run so far (tests read it)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def dimensions(self) -> int:
        return self.model.config.hidden_size

    @property
    def weights_bytes(self) -> int:
        return self.model.weights_bytes

    def token_ids(self, text: str) -> list[int]:
        return self.framed(self.tokenizer.encode(self.prompt + text, add_special_tokens=False).ids)

    def framed(self, ids: Sequence[int]) -> list[int]:
        """Token ids with the tokenizer's special tokens around them, cut to fit as the
        tokenizer cuts (the end goes; the special tokens stay)."""
        body = list(ids)[: max(0, self.max_length - len(self.prefix) - len(self.suffix))]
        return [*self.prefix, *body, *self.suffix]

    def embed(self, inputs: Sequence[list[int]]) -> torch.Tensor:
        """[N, hidden] fp32 vectors for framed token-id lists, in order, in as few forwards as
        whole_prompts.py's bounds allow."""
        out = []
        for start, end in groups([len(ids) for ids in inputs]):
            self.forwards += 1
            out.append(last_hidden(self.model, inputs[start:end]).float())
        if not out:
            return torch.empty((0, self.dimensions))
        vectors = torch.cat(out)
        return F.normalize(vectors, p=2, dim=-1) if self.normalize else vectors


def decoder_embedder(model: LoadedModel, model_id: str) -> DecoderEmbedder:
    """The embedder of a loaded decoder whose files say it embeds (retrieval_files.py)."""
    path = Path(model.path)
    described = sentence_files(path) if path.is_dir() else None
    max_length = model.config.context_length
    prompt, normalize = "", True  # a GGUF: llama-server's unit vectors
    if described is not None:
        max_length = min(max_length, described.max_seq_length or max_length)
        name = described.default_prompt_name
        prompt = described.prompts.get(name, "") if name else ""
        normalize = described.normalize
    tokenizer: tokenizers.Tokenizer = model.tokenizer.backend
    prefix, suffix = _specials(tokenizer, model)
    if path.suffix == ".gguf" and not suffix:  # its header says (its tokenizer may not)
        suffix = _gguf_eos(path)
    return DecoderEmbedder(
        id=model_id,
        model=model,
        tokenizer=tokenizer,
        prompt=prompt,
        normalize=normalize,
        prefix=prefix,
        suffix=suffix,
        max_length=max_length,
    )


def _gguf_eos(path: Path) -> tuple[int, ...]:
    """The EOS a GGUF's `tokenizer.ggml.add_eos_token` appends to every text (llama.cpp's
    converter sets it from a tokenizer that appends one, as Qwen3-Embedding's does)."""
    header = GGUFFile(path)
    eos = header.field("tokenizer.ggml.eos_token_id")
    appends = header.field("tokenizer.ggml.add_eos_token", False)
    return (int(eos),) if appends and eos is not None else ()


def _specials(
    tokenizer: tokenizers.Tokenizer, model: LoadedModel
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The special tokens the tokenizer's post-processor puts before and after a text (and
    the BOS a model that wants one gets, where the post-processor adds none)."""
    bare = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a").ids
    at = next(i for i in range(len(full)) if full[i : i + len(bare)] == bare)
    prefix, suffix = tuple(full[:at]), tuple(full[at + len(bare) :])
    bos = model.tokenizer.bos_token_id
    if model.tokenizer.add_bos_token and bos is not None and not prefix:
        prefix = (bos,)
    return prefix, suffix
