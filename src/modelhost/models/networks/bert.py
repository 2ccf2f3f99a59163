"""BERT-family sentence encoders (sentence-transformers layouts): embeddings, post-LayerNorm
encoder layers with a padding mask, mean pooling over real tokens, L2 normalisation.

`EmbeddingModel.embed` takes texts or token-id lists, batches them (right-padded to the
longest), and returns one unit vector per input. Padding is masked out of attention and out of
the mean, so an input's embedding does not depend on what it was batched with (up to float
rounding of differently shaped matmuls).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    max_seq_length: int  # what the sentence encoder was trained to read; longer input is cut

    @classmethod
    def from_dir(cls, path: Path) -> BertConfig:
        raw = json.loads((path / "config.json").read_text())
        if raw.get("model_type") != "bert" or raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path} is not a BERT encoder with GELU activations")
        sentence = path / "sentence_bert_config.json"
        max_seq = raw["max_position_embeddings"]
        if sentence.is_file():
            max_seq = min(max_seq, json.loads(sentence.read_text()).get("max_seq_length", max_seq))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw["max_position_embeddings"],
            type_vocab_size=raw.get("type_vocab_size", 2),
            layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
            max_seq_length=max_seq,
        )


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        heads = self.num_heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, heads, hidden // heads).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        # `mask` [B, 1, 1, L] keeps real keys only; every query row has at least one (its first).
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attn = attn.transpose(1, 2).reshape(batch, length, hidden)
        x = self.attn_norm(x + self.attn_out(attn))  # BERT normalises after the residual
        return self.out_norm(x + self.down(F.gelu(self.up(x))))


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, hidden)
        self.position = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type = nn.Embedding(config.type_vocab_size, hidden)
        self.norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Last hidden states [B, L, H] for right-padded ids; `attention_mask` [B, L] is 1 on
        real tokens; `token_type_ids` [B, L] tells a pair's segments apart (cross-encoders)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # Sentence encoders read one segment: token type 0 everywhere.
        if token_type_ids is None:
            types = self.token_type.weight[0]
        else:
            types = self.token_type(token_type_ids)
        x = self.word(input_ids) + self.position(positions) + types
        x = self.norm(x)
        mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x


_LAYER_NAMES = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "out_norm",
}
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings": "word",
    "embeddings.position_embeddings": "position",
    "embeddings.token_type_embeddings": "token_type",
    "embeddings.LayerNorm": "norm",
}


def encoder_tensor_name(name: str) -> str | None:
    """Our parameter name for a Hugging Face BERT tensor; None for tensors we do not use."""
    name = name.removeprefix("bert.")
    stem, _, leaf = name.rpartition(".")
    if stem in _EMBEDDING_NAMES:
        return f"{_EMBEDDING_NAMES[stem]}.{leaf}"
    if stem.startswith("encoder.layer."):
        index, _, rest = stem.removeprefix("encoder.layer.").partition(".")
        if rest in _LAYER_NAMES:
            return f"layers.{index}.{_LAYER_NAMES[rest]}.{leaf}"
    return None  # position_ids buffers, the pooler and heads: not the encoder's own


@dataclass(slots=True)
class EmbeddingModel:
    """A loaded sentence encoder: its id, tokenizer and network."""

    id: str
    path: Path
    config: BertConfig
    tokenizer: tokenizers.Tokenizer
    network: BertEncoder
    cls_id: int
    sep_id: int
    pad_id: int

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    @property
    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.network.parameters())

    def token_ids(self, text: str) -> list[int]:
        """[CLS] text [SEP], cut to the encoder's maximum sequence length."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.framed(ids)

    def framed(self, ids: Sequence[int]) -> list[int]:
        """Token ids framed by [CLS] and [SEP] and cut to fit, as the tokenizer would."""
        body = list(ids)[: self.config.max_seq_length - 2]
        return [self.cls_id, *body, self.sep_id]

    @torch.inference_mode()
    def embed(self, inputs: Sequence[list[int]], *, batch_size: int = 32) -> torch.Tensor:
        """Unit vectors [N, H] for framed token-id lists, in order, `batch_size` at a time."""
        out: list[torch.Tensor] = []
        for start in range(0, len(inputs), batch_size):
            chunk = inputs[start : start + batch_size]
            length = max(len(ids) for ids in chunk)
            ids = torch.full((len(chunk), length), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), length), dtype=torch.long)
            for row, row_ids in enumerate(chunk):
                ids[row, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
                mask[row, : len(row_ids)] = 1
            hidden = self.network(ids, mask)
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
            out.append(F.normalize(pooled, p=2, dim=-1))
        return torch.cat(out) if out else torch.empty((0, self.dimensions))


def load_bert(path: Path, model_id: str | None = None) -> EmbeddingModel:
    """A sentence encoder from a directory with config.json, model.safetensors, tokenizer.json."""
    config = BertConfig.from_dir(path)
    network = BertEncoder(config)
    load_weights(network, path, encoder_tensor_name)
    files = EncoderTokenizer.from_dir(path)
    return EmbeddingModel(
        id=model_id or path.name,
        path=path,
        config=config,
        tokenizer=files.tokenizer,
        network=network,
        cls_id=files.cls_id,
        sep_id=files.sep_id,
        pad_id=files.pad_id,
    )


def load_weights(network: nn.Module, path: Path, rename: Callable[[str], str | None]) -> None:
    """`path`'s model.safetensors into `network` (each tensor under `rename`'s name for it;
    None drops it), every parameter accounted for, then fp32 and eval mode."""
    tensors = load_file(str(path / "model.safetensors"))
    named = ((rename(name), t) for name, t in tensors.items())
    state = {ours: t for ours, t in named if ours is not None}
    missing, unexpected = network.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing}, unexpected {unexpected}")
    network.float().eval()


@dataclass(frozen=True, slots=True)
class EncoderTokenizer:
    """A BERT-style folder's tokenizer.json, padding and truncation left to the caller (inputs
    are padded per batch and cut by the model's own rule), with its special tokens' ids."""

    tokenizer: tokenizers.Tokenizer
    cls_id: int
    sep_id: int
    pad_id: int

    @classmethod
    def from_dir(cls, path: Path) -> EncoderTokenizer:
        tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.no_truncation()

        def special(token: str) -> int:
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{path}: the tokenizer has no {token}")
            return int(token_id)

        return cls(tokenizer, special("[CLS]"), special("[SEP]"), special("[PAD]"))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two vectors."""
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp(min=math.ulp(1.0)))
