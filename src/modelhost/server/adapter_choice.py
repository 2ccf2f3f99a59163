"""Which LoRA adapter a request runs with, read the same way on every surface.

A request names an adapter as its `model` (the id `/v1/models` lists it under), or names the
base and adds `adapter`: a name, or `{"name", "scale"}`; or llama-server's per-request
`lora: [{"id", "scale"}]`, `id` the adapter's index in the model's adapter list or its name.
One adapter a request (a list of several is refused), `"none"` the bare base. The stage
checks the name against the model's adapters (404 `model_not_found` when it has none such).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from modelhost.inference.contracts import InferenceRequest, InvalidRequest


def with_adapter(
    inference: InferenceRequest, body: dict[str, Any], adapters: Sequence[str]
) -> InferenceRequest:
    """`inference` with the body's adapter choice (unchanged when it names none)."""
    name, scale = _named(body, adapters)
    if name is None:
        return inference
    return dataclasses.replace(inference, adapter=name, adapter_scale=scale)


def _named(body: dict[str, Any], adapters: Sequence[str]) -> tuple[str | None, float]:
    if "adapter" in body and body["adapter"] is not None:
        return _adapter_field(body["adapter"])
    if "lora" in body and body["lora"] is not None:
        return _lora_field(body["lora"], adapters)
    model = body.get("model")
    if isinstance(model, str):
        for name in (model, model.removesuffix(":latest")):  # Ollama's tag on a listed name
            if name in adapters:
                return name, 1.0
    return None, 1.0


def _adapter_field(value: Any) -> tuple[str, float]:
    if isinstance(value, str):
        return value, 1.0
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return value["name"], _scale(value.get("scale", 1.0), "adapter.scale")
    raise InvalidRequest(
        'adapter must be an adapter\'s name or {"name": ..., "scale": ...}', param="adapter"
    )


def _lora_field(value: Any, adapters: Sequence[str]) -> tuple[str | None, float]:
    message = 'lora must be a list of one {"id": ..., "scale": ...}'
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InvalidRequest(message, param="lora")
    if not value:
        return None, 1.0
    if len(value) > 1:
        raise InvalidRequest("one LoRA adapter a request: lora lists several", param="lora")
    item = value[0]
    ident = item.get("id")
    scale = _scale(item.get("scale", 1.0), "lora.scale")
    if isinstance(ident, int) and not isinstance(ident, bool):
        if not 0 <= ident < len(adapters):
            raise InvalidRequest(f"lora id {ident} is not one of the model's adapters", "lora")
        return adapters[ident], scale
    if isinstance(ident, str):
        return ident, scale
    raise InvalidRequest(message, param="lora")


def _scale(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
        raise InvalidRequest(f"{param} must be a number in [-100, 100]", param=param)
    return float(value)
