"""BERT-family encoders from GGUF files as llama.cpp's convert_hf_to_gguf.py writes them
(architecture "bert": BERT, RoBERTa and XLM-R embedders and rerankers; "nomic-bert":
nomic-embed-text, its queries, keys and values fused in `attn_qkv`, its rotary base under
`nomic-bert.rope.freq_base`).

What the file holds: the tensors under llama.cpp's names (`token_embd`, `blk.N.attn_q`, …;
RoBERTa's position rows before the padding index already cut off), the hyper-parameters under
`bert.*`, the pooling under `bert.pooling_type` (mean when absent, as sentence-transformers
pools a bare model), and the vocabulary: WordPiece as "bert" (a word's first
piece marked with a leading U+2581, continuations bare) or XLM-R's Unigram as "t5" (pieces and
scores). The tokenizer is rebuilt from that vocabulary; WordPiece lowercases, as llama.cpp's does.
A *ForSequenceClassification converts to a reranker: its classifier head is the `cls` (the dense
before the tanh; a BERT classifier's pooler is dropped by the converter) and `cls.output` tensors,
and llama-server serves it with `--reranking` (pooling "rank"); a file whose pooling_type says
rank, or that holds `cls.output`, is one.

A GGUF embedder's vectors are unit length (llama-server normalises them); a GGUF reranker's
score is the raw logit, as llama-server's `/v1/rerank` answers it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import models, normalizers, pre_tokenizers

from modelhost.models.networks.bert import (
    BertConfig,
    BertEncoder,
    EmbeddingModel,
    EncoderTokenizer,
    Framing,
    load_state,
)
from modelhost.models.networks.cross_encoder import BertCrossEncoder, CrossEncoderModel
from modelhost.models.networks.encoder_files import (
    GGUF_ENCODER_TOKENIZERS,
    Pooling,
    gguf_pooling,
)
from modelhost.models.networks.nomic_bert import NomicConfig, NomicEncoder, unfused

_CONTROL = 3  # llama.cpp's token type of a special token
_RANK = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK
_LAYER_NAMES = {
    "attn_q": "query",
    "attn_k": "key",
    "attn_v": "value",
    "attn_output": "attn_out",
    "attn_output_norm": "attn_norm",
    "ffn_up": "up",
    "ffn_gate": "gate",
    "ffn_down": "down",
    "layer_output_norm": "out_norm",
}
_TOP_NAMES = {
    "token_embd": "word",
    "position_embd": "position",
    "token_types": "token_type",
    "token_embd_norm": "norm",
    "cls": "pooler",
    "cls.output": "classifier",
}


class _File:
    """A GGUF file's metadata values and its tensors as fp32."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = GGUFReader(path)

    def value(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            return default
        return field.contents()

    def arch(self, key: str, default: Any = None) -> Any:
        return self.value(f"{self.value('general.architecture')}.{key}", default)

    @property
    def reranks(self) -> bool:
        names = {tensor.name for tensor in self.reader.tensors}
        return self.arch("pooling_type") == _RANK or "cls.output.weight" in names

    def pooling(self) -> str:
        return gguf_pooling(self.arch("pooling_type"), default="mean")

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for tensor in self.reader.tensors:
            data = dequantize(tensor.data, tensor.tensor_type)
            shape = tuple(int(d) for d in reversed(tensor.shape))
            out[tensor.name] = torch.from_numpy(np.array(data, dtype=np.float32)).view(shape)
        return out


def _our_name(name: str) -> str | None:
    stem, _, leaf = name.rpartition(".")
    if stem in _TOP_NAMES:
        ours = _TOP_NAMES[stem]
        return f"{ours}.{leaf}" if ours in ("pooler", "classifier") else f"encoder.{ours}.{leaf}"
    if stem.startswith("blk."):
        index, _, rest = stem.removeprefix("blk.").partition(".")
        if rest in _LAYER_NAMES:
            return f"encoder.layers.{index}.{_LAYER_NAMES[rest]}.{leaf}"
    return None


def _config(file: _File) -> BertConfig:
    hidden = int(file.arch("embedding_length"))
    context = int(file.arch("context_length"))
    return BertConfig(
        vocab_size=len(file.value("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        num_layers=int(file.arch("block_count")),
        num_heads=int(file.arch("attention.head_count")),
        intermediate_size=int(file.arch("feed_forward_length")),
        max_position_embeddings=context,
        type_vocab_size=int(file.value("tokenizer.ggml.token_type_count", 2)),
        layer_norm_eps=float(file.arch("attention.layer_norm_epsilon", 1e-12)),
        max_seq_length=context,
    )


def _nomic_config(file: _File) -> NomicConfig:
    return NomicConfig(
        vocab_size=len(file.value("tokenizer.ggml.tokens")),
        hidden_size=int(file.arch("embedding_length")),
        num_layers=int(file.arch("block_count")),
        num_heads=int(file.arch("attention.head_count")),
        intermediate_size=int(file.arch("feed_forward_length")),
        type_vocab_size=int(file.value("tokenizer.ggml.token_type_count", 2)),
        layer_norm_eps=float(file.arch("attention.layer_norm_epsilon", 1e-12)),
        rope_theta=float(file.arch("rope.freq_base", 1000.0)),
        max_seq_length=int(file.arch("context_length")),
    )


def _tokenizer(file: _File) -> EncoderTokenizer:
    kind = file.value("tokenizer.ggml.model")
    tokens: list[str] = list(file.value("tokenizer.ggml.tokens"))
    unk = int(file.value("tokenizer.ggml.unknown_token_id", 0))
    if kind == "bert":
        types = list(file.value("tokenizer.ggml.token_type"))
        vocab = {
            tok if kind_ == _CONTROL else tok[1:] if tok.startswith("\u2581") else f"##{tok}": i
            for i, (tok, kind_) in enumerate(zip(tokens, types, strict=True))
        }
        tokenizer = tokenizers.Tokenizer(
            models.WordPiece(vocab, unk_token=_token(vocab, unk), continuing_subword_prefix="##")
        )
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        bos_id = file.value("tokenizer.ggml.bos_token_id")
        cls_id = file.value("tokenizer.ggml.cls_token_id", bos_id)
        framing = Framing.bert(int(cls_id), int(file.value("tokenizer.ggml.seperator_token_id")))
    elif kind == "t5":
        scores = list(file.value("tokenizer.ggml.scores"))
        pieces = list(zip(tokens, (float(s) for s in scores), strict=True))
        tokenizer = tokenizers.Tokenizer(models.Unigram(pieces, unk_id=unk, byte_fallback=False))
        charsmap = file.value("tokenizer.ggml.precompiled_charsmap")
        if charsmap is not None and len(charsmap):
            tokenizer.normalizer = normalizers.Precompiled(bytes(charsmap))
        prefix = file.value("tokenizer.ggml.add_space_prefix", True)
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            prepend_scheme="always" if prefix else "never"
        )
        bos = file.value("tokenizer.ggml.bos_token_id")
        eos = file.value("tokenizer.ggml.eos_token_id")
        framing = Framing.roberta(int(bos), int(eos))
    else:
        served = ", ".join(sorted(GGUF_ENCODER_TOKENIZERS))
        raise ValueError(f"{file.path}: its {kind} tokenizer is not supported (only {served})")
    pad = int(file.value("tokenizer.ggml.padding_token_id", 0))
    return EncoderTokenizer(tokenizer, framing, pad)


def _token(vocab: dict[str, int], token_id: int) -> str:
    return next(tok for tok, i in vocab.items() if i == token_id)


def load_gguf_encoder(path: Path, model_id: str | None = None) -> EmbeddingModel:
    """A GGUF sentence encoder: its pooling from `bert.pooling_type`, unit vectors."""
    file = _File(path)
    if file.reranks:
        raise ValueError(f"{path} is a reranker, not an embedder")
    mode = file.pooling()
    config: BertConfig | NomicConfig
    network: BertEncoder | NomicEncoder
    if file.value("general.architecture") == "nomic-bert":
        config = _nomic_config(file)
        network = NomicEncoder(config)
        tensors = unfused(file.tensors(), fused="attn_qkv.weight", split="attn_{}.weight")
    else:
        config = _config(file)
        network = BertEncoder(config)
        tensors = file.tensors()
    load_state(network, tensors, _encoder_name, str(path))
    return EmbeddingModel(
        id=model_id or path.stem,
        path=path,
        config=config,
        text=_tokenizer(file),
        network=network,
        pooling=Pooling(mode, normalize=True),
    )


def _encoder_name(name: str) -> str | None:
    ours = _our_name(name)
    return ours.removeprefix("encoder.") if ours and ours.startswith("encoder.") else None


def load_gguf_reranker(path: Path, model_id: str | None = None) -> CrossEncoderModel:
    """A GGUF reranker (pooling_type rank): the first token through `cls` (with a tanh, when
    the file has it) and `cls.output`; raw logits."""
    file = _File(path)
    if not file.reranks:
        raise ValueError(f"{path} is not a reranker (no classifier head, pooling_type not rank)")
    config = _config(file)
    tensors = file.tensors()
    network = BertCrossEncoder(config, pooler="cls.weight" in tensors)
    load_state(network, tensors, _our_name, str(path))
    return CrossEncoderModel(
        id=model_id or path.stem,
        path=path,
        config=config,
        max_length=config.max_seq_length,
        sigmoid=False,
        text=_tokenizer(file),
        network=network,
    )
