"""Reranking on a cross-encoder or a decoder reranker, protocol-neutral.

`RerankStage.rerank` has its model read the query with each document as that model reads a
pair (a cross-encoder's [CLS] query [SEP] document [SEP]; a decoder reranker's whole prompt),
then scores every document against the query in batched forwards (under an
exclusive lock, off the event loop, as the encoders run embeddings) and answers the documents'
indices best first, with their scores and the tokens the model read. The stage is handed its
model: this module imports no PyTorch, so the HTTP layer reads its contracts freely.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar


class Read(Protocol):
    @property
    def input_ids(self) -> Sequence[int]: ...


R = TypeVar("R", bound=Read)


class Reranker(Protocol[R]):
    """What a reranking model offers the stage (models/networks/cross_encoder.py,
    models/retrieval/decoder_reranker.py)."""

    @property
    def id(self) -> str: ...
    @property
    def weights_bytes(self) -> int: ...
    def read(self, query: str, documents: Sequence[str]) -> list[R]: ...
    def score(self, inputs: Sequence[R]) -> list[float]: ...


@dataclass(frozen=True, slots=True)
class Ranked:
    index: int  # the document's place in the request
    score: float


@dataclass(frozen=True, slots=True)
class RerankResult:
    ranked: list[Ranked]  # best first; ties keep the request's order
    prompt_tokens: int


class RerankStage:
    def __init__(self, model: Reranker[Any]) -> None:
        self.model = model
        self._lock = threading.Lock()

    @property
    def model_id(self) -> str:
        return self.model.id

    def resident_bytes(self) -> int:
        return self.model.weights_bytes

    def close(self) -> None:
        return None  # nothing runs between requests; the weights go with the last reference

    async def rerank(
        self, query: str, documents: Sequence[str], top_n: int | None = None
    ) -> RerankResult:
        """The `top_n` best documents (all when None), best first."""
        model = self.model
        pairs = model.read(query, documents)
        scores = await asyncio.to_thread(self._run, pairs)
        ranked = sorted(
            (Ranked(index, score) for index, score in enumerate(scores)), key=lambda r: -r.score
        )
        # Usage counts every token the model read, the pairs' special tokens included.
        tokens = sum(len(pair.input_ids) for pair in pairs)
        return RerankResult(ranked[:top_n] if top_n is not None else ranked, tokens)

    def _run(self, pairs: list[Any]) -> list[float]:
        with self._lock:
            return self.model.score(pairs)
