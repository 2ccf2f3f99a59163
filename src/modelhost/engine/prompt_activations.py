"""Which bits a model's prompt rows take (`--prompt-activations auto|8|16`, EngineConfig).

8 (models/kernels/packed.py's coarse rows) halves a quantized linear's integer products for a
prompt's tokens whose logits nobody reads; it pays where those linears are most of a prompt's
time: quantized (GGUF) weights on a model wide enough. Measured at 1,200 tokens
(benchmarks/prompt_path.py): Llama-shaped 1B (hidden 2048) and 3B (3072) Q4_K_M files 1.45x and
1.3x the 16-bit prompt speed; SmolLM2 135M (hidden 576) 0.89x, its step's fixed costs being a
larger share. `auto` takes 8 from AUTO_MIN_HIDDEN up, 16 below it and for float weights, so the
embedded models and small test models keep the exact answers of every row alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from modelhost.models.loading.footprint import FLOAT_TYPES

if TYPE_CHECKING:  # the command line parses the choice without importing PyTorch
    from torch import nn

    from modelhost.models.loaded import LoadedModel

PromptActivations = Literal["auto", 8, 16]
AUTO_MIN_HIDDEN = 1536  # hidden sizes from which `auto` takes 8 bits (see the docstring)


def parse_prompt_activations(value: str | int) -> PromptActivations:
    """A command line's or a settings file's choice: "auto", 8 or 16."""
    if value == "auto":
        return "auto"
    if str(value) in ("8", "16"):
        return 8 if str(value) == "8" else 16
    raise ValueError(f"prompt activations are auto, 8 or 16, not {value!r}")


def has_quantized_linears(network: nn.Module) -> bool:
    """Whether any linear of the network computes on integer levels (a packed GGUF type)."""
    from modelhost.models.kernels.packed import QuantLinear

    return any(
        isinstance(module, QuantLinear)
        and any(part.format not in FLOAT_TYPES for part in module.parts)  # integer products
        for module in network.modules()
    )


def auto_bits(hidden_size: int, quantized: bool) -> Literal[8, 16]:
    """`auto`'s choice for a model of this width, with quantized linears or not."""
    return 8 if quantized and hidden_size >= AUTO_MIN_HIDDEN else 16


def prompt_activation_bits(choice: int | str, model: LoadedModel) -> Literal[8, 16]:
    """The bits `choice` gives this model's prompt rows."""
    choice = parse_prompt_activations(choice)
    if choice != "auto":
        return choice
    return auto_bits(model.config.hidden_size, has_quantized_linears(model.network))
