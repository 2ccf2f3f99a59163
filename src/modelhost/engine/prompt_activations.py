"""What a model's prompt rows take (`--prompt-activations auto|8|16|bf16`, EngineConfig).

8 (models/kernels/packed.py's coarse rows) halves a quantized linear's integer products for a
prompt's tokens whose logits nobody reads; it pays where those linears are most of a prompt's
time: quantized (GGUF) weights on a model wide enough. Measured at 1,200 tokens
(benchmarks/prompt_path.py): Llama-shaped 1B (hidden 2048) and 3B (3072) Q4_K_M files 1.45x and
1.3x the 16-bit prompt speed; SmolLM2 135M (hidden 576) 0.89x, its step's fixed costs being a
larger share.

bf16 computes the same rows with PyTorch's bf16 GEMM over the weights dequantized to bf16 a
slice at a time: on a CPU with AMX (Intel Sapphire Rapids and later) oneDNN's tiles multiply
bf16 several times faster than the integer kernels (benchmarks/long_prefill.py); elsewhere
oneDNN emulates bf16, slower than either.

`auto` takes bf16 on a CPU with AMX for a model of packed linears from AUTO_MIN_HIDDEN_BF16 up;
else 8 from AUTO_MIN_HIDDEN up for quantized weights; else 16: small test models keep the exact
answers of every row alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from modelhost.models.loading.footprint import FLOAT_TYPES

if TYPE_CHECKING:  # the command line parses the choice without importing PyTorch
    from torch import nn

    from modelhost.models.loaded import LoadedModel

PromptActivations = Literal["auto", 8, 16, "bf16"]
Resolved = Literal[8, 16, "bf16"]
AUTO_MIN_HIDDEN = 1536  # hidden sizes from which `auto` takes 8 bits (see the docstring)
AUTO_MIN_HIDDEN_BF16 = 512  # and bf16, on a CPU with AMX


def parse_prompt_activations(value: str | int) -> PromptActivations:
    """A command line's or a settings file's choice: "auto", 8, 16 or "bf16"."""
    if value in ("auto", "bf16"):
        return "auto" if value == "auto" else "bf16"
    if str(value) in ("8", "16"):
        return 8 if str(value) == "8" else 16
    raise ValueError(f"prompt activations are auto, 8, 16 or bf16, not {value!r}")


def has_packed_linears(network: nn.Module) -> bool:
    """Whether the network's linears run on the native kernels (which bf16 rows bypass)."""
    from modelhost.models.kernels.packed import QuantLinear

    return any(isinstance(module, QuantLinear) for module in network.modules())


def has_quantized_linears(network: nn.Module) -> bool:
    """Whether any linear of the network computes on integer levels (a packed GGUF type)."""
    from modelhost.models.kernels.packed import QuantLinear

    return any(
        isinstance(module, QuantLinear)
        and any(part.format not in FLOAT_TYPES for part in module.parts)  # integer products
        for module in network.modules()
    )


def auto_bits(
    hidden_size: int, quantized: bool, packed: bool = False, amx: bool = False
) -> Resolved:
    """`auto`'s choice for a model of this width, with quantized (or any packed) linears or
    not, on a CPU with AMX or not."""
    if amx and packed and hidden_size >= AUTO_MIN_HIDDEN_BF16:
        return "bf16"
    return 8 if quantized and hidden_size >= AUTO_MIN_HIDDEN else 16


def prompt_activation_bits(choice: int | str, model: LoadedModel) -> Resolved:
    """What `choice` gives this model's prompt rows: 8, 16 or "bf16"."""
    from modelhost.models.loading.quant import amx_in_hardware

    choice = parse_prompt_activations(choice)
    if choice != "auto":
        return choice
    network = model.network
    return auto_bits(
        model.config.hidden_size,
        has_quantized_linears(network),
        packed=has_packed_linears(network),
        amx=amx_in_hardware(),
    )
