"""BERT-family sentence encoders (BERT, RoBERTa, XLM-R; sentence-transformers layouts):
post-LayerNorm encoder layers with a padding mask, then the model's own pooling (cls, mean, max
or last token over real tokens, encoder_files.py) and L2 normalisation when it has it.

RoBERTa and XLM-R are BERT with their positions counted from `pad_token_id + 1` (Hugging Face
numbers real tokens after the padding index; a GGUF has the rows before cut off), one token type,
and `<s> … </s>` framing; the tokenizer's own post-processor says how a text and a pair are
framed (`Framing`), so the ids match the reference's token for token.

`EmbeddingModel.embed` takes framed token-id lists, batches them (right-padded to the longest),
and returns one vector per input. Padding is masked out of attention and out of the pooling, so
an input's embedding does not depend on what it was batched with (up to float rounding of
differently shaped matmuls).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import tokenizers
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from modelhost.models.networks.encoder_files import Pooling, read_pooling

# config.json's model_type whose positions are counted from the padding index (docstring).
_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta"})
_MODEL_TYPES = frozenset({"bert", *_OFFSET_POSITIONS})


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
    position_offset: int = 0  # the position row of the first token (module docstring)

    @classmethod
    def from_dir(cls, path: Path) -> BertConfig:
        raw = json.loads((path / "config.json").read_text())
        if raw.get("model_type") not in _MODEL_TYPES or raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path} is not a BERT-family encoder with GELU activations")
        offset = raw.get("pad_token_id", 1) + 1 if raw["model_type"] in _OFFSET_POSITIONS else 0
        sentence = path / "sentence_bert_config.json"
        max_seq = raw["max_position_embeddings"] - offset
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
            position_offset=offset,
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
        offset = self.config.position_offset
        positions = torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device)
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
    """Our parameter name for a Hugging Face BERT-family tensor; None for tensors we do not
    use."""
    name = name.removeprefix("bert.").removeprefix("roberta.")
    # None: position_ids buffers, the pooler and heads, not the encoder's own
    return renamed(name, _EMBEDDING_NAMES, "encoder.layer.", _LAYER_NAMES)


def renamed(name: str, top: dict[str, str], layer_prefix: str, layer: dict[str, str]) -> str | None:
    """`name` (a checkpoint's, its model prefix removed) as our parameter's: a module outside
    the layers by `top`, one of layer N (`layer_prefix`N.) by `layer`; None for any other."""
    stem, _, leaf = name.rpartition(".")
    if stem in top:
        return f"{top[stem]}.{leaf}"
    if stem.startswith(layer_prefix):
        index, _, rest = stem.removeprefix(layer_prefix).partition(".")
        if rest in layer:
            return f"layers.{index}.{layer[rest]}.{leaf}"
    return None


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """One vector a row [B, H] from right-padded hidden states, as sentence-transformers' Pooling
    and Normalize modules compute it."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if pooling.mode == "cls":
        pooled = hidden[:, 0]
    elif pooling.mode == "lasttoken":
        last = mask.sum(dim=1).clamp(min=1) - 1
        pooled = hidden[torch.arange(hidden.shape[0]), last]
    elif pooling.mode == "max":
        pooled = hidden.masked_fill(weights == 0, -1e9).max(dim=1).values
    else:
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=-1) if pooling.normalize else pooled


class EncoderShape(Protocol):
    """What serving an encoder reads of its config (BertConfig, nomic_bert's NomicConfig)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def max_seq_length(self) -> int: ...


@dataclass(slots=True)
class EmbeddingModel:
    """A loaded sentence encoder: its id, tokenizer, network and pooling."""

    id: str
    path: Path
    config: EncoderShape
    text: EncoderTokenizer
    network: nn.Module  # input ids, attention mask → hidden states [B, L, H]
    pooling: Pooling

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    @property
    def normalize(self) -> bool:
        """Whether its vectors are unit length (a Normalize module in its files)."""
        return self.pooling.normalize

    @property
    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.network.parameters())

    def token_ids(self, text: str) -> list[int]:
        """The text framed by its special tokens, cut to the encoder's maximum length."""
        ids = self.text.tokenizer.encode(text, add_special_tokens=False).ids
        return self.framed(ids)

    def framed(self, ids: Sequence[int]) -> list[int]:
        """Token ids framed by the special tokens and cut to fit, as the tokenizer would."""
        before, after = self.text.framing.single
        body = list(ids)[: self.config.max_seq_length - len(before) - len(after)]
        return [*before, *body, *after]

    @torch.inference_mode()
    def embed(self, inputs: Sequence[list[int]], *, batch_size: int = 32) -> torch.Tensor:
        """Vectors [N, H] for framed token-id lists, in order, `batch_size` at a time."""
        out: list[torch.Tensor] = []
        for start in range(0, len(inputs), batch_size):
            chunk = inputs[start : start + batch_size]
            length = max(len(ids) for ids in chunk)
            ids = torch.full((len(chunk), length), self.text.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), length), dtype=torch.long)
            for row, row_ids in enumerate(chunk):
                ids[row, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
                mask[row, : len(row_ids)] = 1
            out.append(pool(self.network(ids, mask), mask, self.pooling))
        return torch.cat(out) if out else torch.empty((0, self.dimensions))


def load_bert(path: Path, model_id: str | None = None) -> EmbeddingModel:
    """A sentence encoder from a directory with config.json, model.safetensors, tokenizer.json
    (and sentence-transformers' modules.json and pooling config when it has them)."""
    config = BertConfig.from_dir(path)
    network = BertEncoder(config)
    load_weights(network, path, encoder_tensor_name)
    return EmbeddingModel(
        id=model_id or path.name,
        path=path,
        config=config,
        text=EncoderTokenizer.from_dir(path),
        network=network,
        pooling=read_pooling(path),
    )


def load_weights(network: nn.Module, path: Path, rename: Callable[[str], str | None]) -> None:
    """`path`'s model.safetensors into `network` (each tensor under `rename`'s name for it;
    None drops it), every parameter accounted for, then fp32 and eval mode."""
    load_state(network, load_file(str(path / "model.safetensors")), rename, str(path))


def load_state(
    network: nn.Module,
    tensors: dict[str, torch.Tensor],
    rename: Callable[[str], str | None],
    source: str,
) -> None:
    """Named tensors into `network` under `rename`'s names, every parameter accounted for."""
    named = ((rename(name), t) for name, t in tensors.items())
    state = {ours: t for ours, t in named if ours is not None}
    missing, unexpected = network.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{source}: missing tensors {missing}, unexpected {unexpected}")
    network.float().eval()


@dataclass(frozen=True, slots=True)
class Framing:
    """The special tokens around one text and around a pair, and the pair's token types: what
    the tokenizer's post-processor adds ([CLS] a [SEP] b [SEP] for BERT, <s> a </s></s> b </s>
    for RoBERTa and XLM-R)."""

    single: tuple[list[int], list[int]]  # before, after
    pair: tuple[list[int], list[int], list[int]]  # before, between, after
    pair_types: tuple[int, int]  # the first part's (before, a, between), the second's (b, after)

    @property
    def pair_specials(self) -> int:
        return sum(len(part) for part in self.pair)

    @classmethod
    def bert(cls, cls_id: int, sep_id: int) -> Framing:
        return cls(([cls_id], [sep_id]), ([cls_id], [sep_id], [sep_id]), (0, 1))

    @classmethod
    def roberta(cls, bos_id: int, eos_id: int) -> Framing:
        return cls(([bos_id], [eos_id]), ([bos_id], [eos_id, eos_id], [eos_id]), (0, 0))

    @classmethod
    def of(cls, tokenizer: tokenizers.Tokenizer) -> Framing:
        """Read off the post-processor by framing two probe tokens."""
        a = tokenizer.encode("a", add_special_tokens=False)
        b = tokenizer.encode("b", add_special_tokens=False)
        one = tokenizer.post_process(a, None, add_special_tokens=True).ids
        both = tokenizer.post_process(a, b, add_special_tokens=True)
        at, bt = len(a.ids), len(b.ids)
        i = both.ids.index(a.ids[0])
        j = both.ids.index(b.ids[0], i + at)
        single_i = one.index(a.ids[0])
        return cls(
            (one[:single_i], one[single_i + at :]),
            (both.ids[:i], both.ids[i + at : j], both.ids[j + bt :]),
            (both.type_ids[i], both.type_ids[j]),
        )


@dataclass(frozen=True, slots=True)
class EncoderTokenizer:
    """An encoder folder's tokenizer.json, padding and truncation left to the caller (inputs
    are padded per batch and cut by the model's own rule), with its framing and padding id."""

    tokenizer: tokenizers.Tokenizer
    framing: Framing
    pad_id: int

    @classmethod
    def from_dir(cls, path: Path) -> EncoderTokenizer:
        tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        pad_id = tokenizer.token_to_id("[PAD]")
        if pad_id is None:
            pad_id = tokenizer.token_to_id("<pad>")
        if pad_id is None:
            raise ValueError(f"{path}: the tokenizer has no [PAD] or <pad>")
        return cls(tokenizer, Framing.of(tokenizer), int(pad_id))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two vectors."""
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp(min=math.ulp(1.0)))
