"""A Hugging Face folder of bf16 safetensors loads at its own size, or smaller in the int8 and
int4 modes, and answers as its fp32 reading does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from prompt_logits import prompt_logits
from tiny_models import make_tiny_checkpoint

from modelhost.models.kernels import native
from modelhost.models.loading.loader import load_model

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no native kernels here")


@pytest.fixture(scope="module")
def bf16_folder(smollm2, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf-bf16")
    fp32 = make_tiny_checkpoint(root / "fp32", "llama", smollm2)
    model = transformers.AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16)
    folder = root / "tiny-bf16"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fp32 / name, folder / name)
    return folder


def tensor_bytes(folder: Path) -> int:
    return (folder / "model.safetensors").stat().st_size


def logits(folder: Path, quantize: str) -> tuple[torch.Tensor, int]:
    model = load_model(str(folder), quantize=quantize)
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    return prompt_logits(model, ids), model.weights_bytes


def test_auto_keeps_bf16_weights_as_they_are_at_their_own_size(bf16_folder):
    got, held = logits(bf16_folder, "auto")
    expected, _ = logits(bf16_folder, "none")  # the same bf16 values, in fp32
    assert held < 1.05 * tensor_bytes(bf16_folder)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("mode", "share", "tolerance"), [("int8", 0.6, 0.02), ("int4", 0.4, 0.2)])
def test_int8_and_int4_hold_less_and_answer_close_to_the_reference(
    bf16_folder, mode, share, tolerance
):
    got, held = logits(bf16_folder, mode)
    expected, _ = logits(bf16_folder, "none")
    assert held < share * tensor_bytes(bf16_folder)
    assert ((got - expected).norm() / expected.norm()).item() < tolerance
