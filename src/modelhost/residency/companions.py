"""Opening a model for serving by what its registry entry says it does, the same way in-process
and in a worker: a generative model gets an engine and its stage; a companion (a sentence encoder
serving `/v1/embeddings`, a cross-encoder serving `/v1/rerank`, a Whisper model serving
`/v1/audio/*`) its own stage; a decoder embedder or reranker loads as a decoder does (its
quantization, its progress) and gets the embeddings or rerank stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from modelhost.models.retrieval.retrieval_files import is_decoder


def open_stage(
    path: Path,
    model_id: str,
    operations: Sequence[str],
    load_model: Callable[[str], Any],
    build_stage: Callable[[Any], Any],
) -> Any:
    """The stage that serves the model at `path` under the registry's stable `model_id`."""
    if "generate" not in operations and not is_decoder(Path(path)):
        return open_companion(path, model_id, operations)
    model = load_model(str(path))
    model.id = model_id  # the registry's id, not the file's or snapshot's name
    if "generate" not in operations:  # a decoder embedder or reranker: a stage of its own
        return decoder_companion(model, operations)
    return build_stage(model)


def decoder_companion(model: Any, operations: Sequence[str]) -> Any:
    """The stage of a loaded decoder whose files say it embeds or reranks
    (models/retrieval/retrieval_files.py)."""
    if "embed" in operations:
        from modelhost.inference.embeddings import EncoderStage
        from modelhost.models.retrieval.decoder_embedder import decoder_embedder

        return EncoderStage(decoder_embedder(model, model.id))
    from modelhost.inference.rerank import RerankStage
    from modelhost.models.retrieval.decoder_reranker import decoder_reranker

    return RerankStage(decoder_reranker(model, model.id))


def open_companion(path: Path, model_id: str, operations: Sequence[str]) -> Any:
    """The stage that serves a companion model from its files."""
    if "embed" in operations:
        from modelhost.inference.embeddings import EncoderStage
        from modelhost.models.loading.encoders import load_sentence_encoder

        return EncoderStage(load_sentence_encoder(Path(path), model_id))
    if "rerank" in operations:
        from modelhost.inference.rerank import RerankStage
        from modelhost.models.loading.encoders import load_reranker

        return RerankStage(load_reranker(Path(path), model_id))
    if "transcribe" in operations:
        from modelhost.audio.transcriber import load_transcriber

        return load_transcriber(Path(path), model_id)
    raise ValueError(f"{model_id}: no companion serves {', '.join(operations)}")
