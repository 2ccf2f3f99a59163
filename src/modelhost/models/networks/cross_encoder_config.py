"""What a cross-encoder's config.json says, read without PyTorch (the registry lists rerankers
from it): whether a folder is one, why it cannot be served, and how its logit becomes a score.

sentence-transformers' `CrossEncoder.predict` applies, by default, the activation config.json
names (`sentence_transformers.activation_fn` since v4, `sbert_ce_default_activation_function`
before), else `Sigmoid` for one label; ms-marco models name `Identity` (raw logits).
"""

from __future__ import annotations

from typing import Any

# The classifiers served, by config.json's architecture, with the model_type each must have.
ARCHITECTURES = {
    "BertForSequenceClassification": "bert",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
    "RobertaForSequenceClassification": "roberta",
}
_ACTIVATIONS = {"Sigmoid": True, "Identity": False}  # the class name's tail: apply a sigmoid?


def is_cross_encoder(raw: dict[str, Any]) -> bool:
    """A config.json of a sequence classifier: what sentence-transformers loads as a
    CrossEncoder (the registry lists it as a reranker)."""
    return any(str(a).endswith("ForSequenceClassification") for a in raw.get("architectures") or ())


def cross_encoder_refusal(raw: dict[str, Any]) -> str | None:
    """Why a sequence-classifier folder cannot be served as a reranker (None: it can)."""
    architectures = [str(a) for a in raw.get("architectures") or ()]
    if not any(ARCHITECTURES.get(a) == raw.get("model_type") for a in architectures):
        served = ", ".join(ARCHITECTURES)
        return f"{', '.join(architectures)} rerankers are not served yet (only {served})"
    if _num_labels(raw) != 1:
        return f"a reranker scores with one label; this classifier has {_num_labels(raw)}"
    if _activation_name(raw).rpartition(".")[2] not in _ACTIVATIONS:
        return f"its score activation {_activation_name(raw)} is not supported"
    return None


def _num_labels(raw: dict[str, Any]) -> int:
    labels = raw.get("id2label")
    return int(raw.get("num_labels") or (len(labels) if isinstance(labels, dict) else 2))


def _activation_name(raw: dict[str, Any]) -> str:
    """The activation sentence-transformers applies to the logit by default (module docstring)."""
    saved = raw.get("sentence_transformers")
    if isinstance(saved, dict) and saved.get("activation_fn"):
        return str(saved["activation_fn"])
    return str(raw.get("sbert_ce_default_activation_function") or "torch.nn.Sigmoid")


def applies_sigmoid(raw: dict[str, Any]) -> bool:
    """Whether the score is the logit's sigmoid (else the logit itself)."""
    return _ACTIVATIONS[_activation_name(raw).rpartition(".")[2]]
