"""BERT-family cross-encoders (`BertForSequenceClassification`,
`XLMRobertaForSequenceClassification` with one label): a query and a document read together as
one pair, framed as the tokenizer frames a pair ([CLS] query [SEP] document [SEP] with token
types 0 then 1; <s> query </s></s> document </s> for XLM-R); a dense + tanh on the first token
(BERT's pooler, RoBERTa's `classifier.dense`) and the output projection give one logit a pair.
A GGUF reranker converted from a BERT classifier has no pooler (convert_hf_to_gguf.py drops
it): its logit is the projection of the first token, as llama-server computes it.

The score is what sentence-transformers' `CrossEncoder.predict` returns by default: the logit
through the activation the model's config.json names, else a sigmoid (cross_encoder_config.py).
A pair longer than the model's window is cut as Hugging Face tokenizers cut it
(`truncation="longest_first"`), so ids match the reference's token for token.

`CrossEncoderModel.score` runs many pairs as padded batches (attention mask, token types), as
many pairs a forward as fit a token budget: a query with 100 short documents is one forward.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from modelhost.models.networks.bert import (
    BertConfig,
    BertEncoder,
    EncoderTokenizer,
    encoder_tensor_name,
    load_weights,
)
from modelhost.models.networks.cross_encoder_config import applies_sigmoid, cross_encoder_refusal

# Padded tokens a forward: bounds its working memory (attention is rows x heads x L x L).
BATCH_TOKENS = 16384


class BertCrossEncoder(nn.Module):
    def __init__(self, config: BertConfig, *, pooler: bool = True) -> None:
        super().__init__()
        self.encoder = BertEncoder(config)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if pooler else None
        self.classifier = nn.Linear(config.hidden_size, 1)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        """One logit per row [B] for right-padded pairs."""
        hidden = self.encoder(input_ids, attention_mask, token_type_ids)[:, 0]
        if self.pooler is not None:
            hidden = torch.tanh(self.pooler(hidden))
        return self.classifier(hidden).squeeze(-1)


# The classification head's tensors: BERT's pooler + classifier, RoBERTa's two-layer head.
_HEAD_NAMES = {
    "bert.pooler.dense": "pooler",
    "classifier.dense": "pooler",
    "classifier.out_proj": "classifier",
    "classifier": "classifier",
}


def _tensor_name(name: str) -> str | None:
    """Our parameter name for a Hugging Face *ForSequenceClassification tensor."""
    stem, _, leaf = name.rpartition(".")
    if stem in _HEAD_NAMES:
        return f"{_HEAD_NAMES[stem]}.{leaf}"
    ours = encoder_tensor_name(name)
    return None if ours is None else f"encoder.{ours}"


def longest_first(query: int, document: int, budget: int) -> tuple[int, int]:
    """How many tokens of each side a pair keeps under `budget` (the window less its three
    special tokens), as Hugging Face tokenizers' `longest_first` cuts: the shorter side whole
    when it takes at most half, else both sides cut to halves (the second gets the odd token)."""
    if query + document <= budget:
        return query, document
    swap = query > document
    short, long = (document, query) if swap else (query, document)
    long = short if short > budget else max(short, budget - short)
    if short + long > budget:
        short, long = budget // 2, budget // 2 + budget % 2
    return (long, short) if swap else (short, long)


@dataclass(frozen=True, slots=True)
class Pair:
    input_ids: list[int]
    token_type_ids: list[int]


@dataclass(slots=True)
class CrossEncoderModel:
    """A loaded cross-encoder: its id, tokenizer, network and how its logit becomes a score."""

    id: str
    path: Path
    config: BertConfig
    max_length: int  # the window a pair is cut to, special tokens included
    sigmoid: bool
    text: EncoderTokenizer
    network: BertCrossEncoder
    forwards: int = 0  # batched forwards run so far (tests and logs read it)

    @property
    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.network.parameters())

    def tokens(self, text: str) -> list[int]:
        return list(self.text.tokenizer.encode(text, add_special_tokens=False).ids)

    def read(self, query: str, documents: Sequence[str]) -> list[Pair]:
        """The query paired with each document (what inference/rerank.py's stage scores)."""
        query_ids = self.tokens(query)
        return [self.pair(query_ids, self.tokens(document)) for document in documents]

    def pair(self, query: Sequence[int], document: Sequence[int]) -> Pair:
        """The pair framed as the tokenizer frames it, cut to the window, with its token types
        (all 0 for a model with one token type: RoBERTa and XLM-R)."""
        framing = self.text.framing
        budget = self.max_length - framing.pair_specials
        keep_q, keep_d = longest_first(len(query), len(document), budget)
        before, between, after = framing.pair
        first = [*before, *query[:keep_q], *between]
        second = [*document[:keep_d], *after]
        types = framing.pair_types if self.config.type_vocab_size > 1 else (0, 0)
        return Pair([*first, *second], [types[0]] * len(first) + [types[1]] * len(second))

    @torch.inference_mode()
    def score(self, pairs: Sequence[Pair]) -> list[float]:
        """One score per pair, in order, as few padded forwards as BATCH_TOKENS allows."""
        scores: list[float] = []
        start = 0
        while start < len(pairs):
            end, longest = start, 0
            while end < len(pairs):
                longest_with = max(longest, len(pairs[end].input_ids))
                if end > start and longest_with * (end - start + 1) > BATCH_TOKENS:
                    break
                longest, end = longest_with, end + 1
            scores.extend(self._forward(pairs[start:end], longest))
            start = end
        return scores

    def _forward(self, pairs: Sequence[Pair], length: int) -> list[float]:
        ids = torch.full((len(pairs), length), self.text.pad_id, dtype=torch.long)
        types = torch.zeros((len(pairs), length), dtype=torch.long)
        mask = torch.zeros((len(pairs), length), dtype=torch.long)
        for row, pair in enumerate(pairs):
            n = len(pair.input_ids)
            ids[row, :n] = torch.tensor(pair.input_ids, dtype=torch.long)
            types[row, :n] = torch.tensor(pair.token_type_ids, dtype=torch.long)
            mask[row, :n] = 1
        self.forwards += 1
        logits = self.network(ids, mask, types)
        return (torch.sigmoid(logits) if self.sigmoid else logits).tolist()


def _max_length(path: Path, config: BertConfig) -> int:
    """The tokenizer's `model_max_length` (what CrossEncoder cuts to), within the positions."""
    window = config.max_seq_length
    tokenizer_config = path / "tokenizer_config.json"
    if tokenizer_config.is_file():
        declared = json.loads(tokenizer_config.read_text()).get("model_max_length")
        if isinstance(declared, int) and 0 < declared < window:
            window = declared
    return window


def load_cross_encoder(path: Path, model_id: str | None = None) -> CrossEncoderModel:
    """A cross-encoder from a folder with config.json, model.safetensors, tokenizer.json."""
    raw = json.loads((path / "config.json").read_text())
    refusal = cross_encoder_refusal(raw)
    if refusal is not None:
        raise ValueError(f"{path}: {refusal}")
    config = BertConfig.from_dir(path)
    network = BertCrossEncoder(config)
    load_weights(network, path, _tensor_name)
    return CrossEncoderModel(
        id=model_id or path.name,
        path=path,
        config=config,
        max_length=_max_length(path, config),
        sigmoid=applies_sigmoid(raw),
        text=EncoderTokenizer.from_dir(path),  # pairs are cut here, longest first
        network=network,
    )
