"""The names of the ways CPU linears can hold their weights (models/loading/quant.py says what each
does); kept apart so the command line and the server's front process can name them without
importing PyTorch."""

import os

MODES = ("auto", "int8", "int4", "none")
DEFAULT_MODE = "auto"
HELP = (
    "how CPU linears hold weights: auto (each tensor in its file's own quantization; the "
    "default), int8 or int4 (float weights quantized; int4 also squeezes wider types), none "
    "(fp32, the reference maths)"
)


def default_mode() -> str:
    """`MODELHOST_QUANTIZE` (one of MODES), else DEFAULT_MODE."""
    return os.environ.get("MODELHOST_QUANTIZE") or DEFAULT_MODE
