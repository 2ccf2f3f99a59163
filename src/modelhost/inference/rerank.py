"""Reranking on a cross-encoder, protocol-neutral.

`RerankStage.rerank` scores every document against the query in batched forwards (under an
exclusive lock, off the event loop, as the encoders run embeddings) and answers the documents'
indices best first, with their scores and the tokens the model read. The stage is handed its
model: this module imports no PyTorch, so the HTTP layer reads its contracts freely.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelhost.models.networks.cross_encoder import CrossEncoderModel, Pair


@dataclass(frozen=True, slots=True)
class Ranked:
    index: int  # the document's place in the request
    score: float


@dataclass(frozen=True, slots=True)
class RerankResult:
    ranked: list[Ranked]  # best first; ties keep the request's order
    prompt_tokens: int


class RerankStage:
    def __init__(self, model: CrossEncoderModel) -> None:
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
        query_ids = model.tokens(query)
        pairs = [model.pair(query_ids, model.tokens(document)) for document in documents]
        scores = await asyncio.to_thread(self._run, pairs)
        ranked = sorted(
            (Ranked(index, score) for index, score in enumerate(scores)), key=lambda r: -r.score
        )
        # Usage counts every token the model read, the pairs' special tokens included.
        tokens = sum(len(pair.input_ids) for pair in pairs)
        return RerankResult(ranked[:top_n] if top_n is not None else ranked, tokens)

    def _run(self, pairs: list[Pair]) -> list[float]:
        with self._lock:
            return self.model.score(pairs)
