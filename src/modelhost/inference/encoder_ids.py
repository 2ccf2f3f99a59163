"""Which model ids name sentence encoders, and the errors for asking the wrong kind of model
(encoders, rerankers): what the HTTP layer decides before any encoder is loaded, so without
PyTorch."""

from __future__ import annotations

from modelhost.inference.contracts import InvalidRequest
from modelhost.models.loading.embedded import EMBEDDED_ENCODERS

EmbeddingInput = str | list[int]


def is_encoder(model_id: object) -> bool:
    return isinstance(model_id, str) and model_id in EMBEDDED_ENCODERS


# The reference's refusals of a model asked for what it does not do, written once: the HTTP
# layer's 400s below and the router's wrong-operation refusals (residency/router.py) read them.


def not_an_embedding_model_message(model_id: str) -> str:
    return (
        f'served model "{model_id}" is not an embedding model; serve an embedding model '
        "(e.g. Qwen3-Embedding) to use /v1/embeddings"
    )


def embedding_model_only_message(model_id: str) -> str:
    return f'model "{model_id}" is an embedding model; it serves /v1/embeddings only'


def not_an_embedding_model(model_id: str) -> InvalidRequest:
    return InvalidRequest(not_an_embedding_model_message(model_id), param="model")


def embedding_model_only(model_id: str) -> InvalidRequest:
    return InvalidRequest(embedding_model_only_message(model_id), param="model")


# Rerankers (cross-encoders, decoder rerankers) serve /v1/rerank and nothing else; the same
# refusals both ways.


def not_a_reranker_message(model_id: str) -> str:
    return (
        f'model "{model_id}" is not a reranker; serve a cross-encoder '
        "(a BERT or XLM-R classifier, folder or GGUF) or a Qwen3-Reranker to use /v1/rerank"
    )


def reranker_only_message(model_id: str) -> str:
    return f'model "{model_id}" is a reranker; it serves /v1/rerank only'


def not_a_reranker(model_id: str) -> InvalidRequest:
    return InvalidRequest(not_a_reranker_message(model_id), param="model")
