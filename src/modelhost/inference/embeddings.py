"""Embeddings on the embedded sentence encoders, protocol-neutral.

`Encoders` loads an encoder by id on first use (once, off the event loop) and keeps it;
`EncoderStage.embed` runs one request's inputs as padded batches under an exclusive lock (the
reference runs embeddings under the engine's exclusive lease, not in the generation batch), then
applies the requested `dimensions`: the leading components (Matryoshka), re-normalised to unit
length when the model's own vectors are.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from modelhost.inference.contracts import InvalidRequest
from modelhost.inference.encoder_ids import EmbeddingInput
from modelhost.models.loading.embedded import encoder_path
from modelhost.models.networks.bert import EmbeddingModel, load_bert


class VocabSize(Protocol):
    @property
    def vocab_size(self) -> int: ...


class Embedder(Protocol):
    """What an embedding model offers the stage: a BERT encoder (models/networks/bert.py) or
    a decoder embedder (models/retrieval/decoder_embedder.py)."""

    @property
    def id(self) -> str: ...
    @property
    def config(self) -> VocabSize: ...
    @property
    def dimensions(self) -> int: ...
    @property
    def weights_bytes(self) -> int: ...
    @property
    def normalize(self) -> bool: ...
    def token_ids(self, text: str) -> list[int]: ...
    def framed(self, ids: Sequence[int]) -> list[int]: ...
    def embed(self, inputs: Sequence[list[int]]) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    vectors: list[list[float]]
    prompt_tokens: int


class EncoderStage:
    def __init__(self, model: Embedder) -> None:
        self.model = model
        self._lock = threading.Lock()

    @property
    def model_id(self) -> str:
        return self.model.id

    def resident_bytes(self) -> int:
        return self.model.weights_bytes

    def close(self) -> None:
        return None  # nothing runs between requests; the weights go with the last reference

    async def embed(
        self, inputs: Sequence[EmbeddingInput], dimensions: int | None = None
    ) -> EmbeddingResult:
        model = self.model
        if dimensions is not None and not 1 <= dimensions <= model.dimensions:
            raise InvalidRequest(
                f"dimensions must be between 1 and {model.dimensions} for {model.id}",
                param="dimensions",
            )
        framed = [self._framed(item, index) for index, item in enumerate(inputs)]
        vectors = await asyncio.to_thread(self._run, framed)
        if dimensions is not None and dimensions < model.dimensions:
            vectors = vectors[:, :dimensions]
            if model.normalize:
                vectors = F.normalize(vectors, p=2, dim=-1)
        # Usage counts the tokens the encoder read, the special tokens included.
        return EmbeddingResult(vectors.tolist(), sum(len(ids) for ids in framed))

    def _run(self, framed: list[list[int]]) -> torch.Tensor:
        with self._lock:
            return self.model.embed(framed)

    def _framed(self, item: EmbeddingInput, index: int) -> list[int]:
        if isinstance(item, str):
            return self.model.token_ids(item)
        vocab = self.model.config.vocab_size
        if any(not 0 <= token < vocab for token in item):
            raise InvalidRequest(
                f"input[{index}] has a token id outside 0..{vocab - 1}", param="input"
            )
        return self.model.framed(item)


class Encoders:
    """The embedded encoders this process has loaded, by id; each is loaded once."""

    def __init__(self) -> None:
        self._stages: dict[str, EncoderStage] = {}
        self._lock = asyncio.Lock()

    async def get(self, model_id: str) -> EncoderStage:
        async with self._lock:
            stage = self._stages.get(model_id)
            if stage is None:
                stage = EncoderStage(await asyncio.to_thread(_load, model_id))
                self._stages[model_id] = stage
            return stage


def _load(model_id: str) -> EmbeddingModel:
    path = encoder_path(model_id)
    if path is None:
        raise InvalidRequest(f"model {model_id!r} is not an embedding model", param="model")
    return load_bert(path, model_id)
