"""Every GGUF type people download loads in its own form, answers as the fp32 reference does,
costs about its file, and loads tensor by tensor; a type the kernels lack is refused by name."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType
from prompt_logits import prompt_logits
from synthetic_files import TYPES, retype_tensor, write_tiny

from modelhost.models.kernels import native
from modelhost.models.loading.gguf_header import read_header
from modelhost.models.loading.loader import load_model
from modelhost.models.loading.weights import UnsupportedTensor
from modelhost.residency.registry import ModelRegistry

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no native kernels here")
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. " * 3


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("synthetic")
    return {qtype: write_tiny(folder / f"tiny-{qtype.lower()}.gguf", qtype) for qtype in TYPES}


@pytest.mark.parametrize("qtype", TYPES)
def test_each_type_answers_as_its_fp32_dequantization_does(files, qtype):
    model = load_model(str(files[qtype]))
    reference = load_model(str(files[qtype]), quantize="none")
    ids = model.tokenizer.encode(PROMPT)
    got, expected = prompt_logits(model, ids), prompt_logits(reference, ids)
    # Only the activations' rounding to 16 bits separates the two.
    assert ((got - expected).norm() / expected.norm()).item() < 2e-3
    assert torch.equal(got.argmax(dim=-1), expected.argmax(dim=-1))


@pytest.mark.parametrize("qtype", TYPES)
def test_each_type_holds_about_the_bytes_of_its_tensors(files, qtype):
    tensor_bytes = sum(t["nbytes"] for t in read_header(files[qtype])[1])
    held = load_model(str(files[qtype])).weights_bytes
    assert tensor_bytes * 0.99 < held < tensor_bytes * 1.2


def test_int4_mode_holds_a_q8_0_file_in_about_five_eighths_of_its_bytes(files):
    tensor_bytes = sum(t["nbytes"] for t in read_header(files["Q8_0"])[1])
    held = load_model(str(files["Q8_0"]), quantize="int4").weights_bytes
    assert held < tensor_bytes * 0.65  # 5 bits a weight against 8.5


def test_loading_reports_its_progress_by_the_bytes_of_tensors_read(files):
    seen: list[float] = []
    load_model(str(files["Q4_K_M"]), progress=seen.append)
    assert len(seen) > 5
    assert seen == sorted(seen) and seen[-1] == pytest.approx(1.0, abs=0.02)


@pytest.fixture
def iq_file(tmp_path: Path) -> Path:
    """A Q4_0 file whose ffn_down of layer 1 says IQ4_NL (the same block size)."""
    path = write_tiny(tmp_path / "tiny-iq.gguf", "Q4_0")
    retype_tensor(path, "blk.1.ffn_down.weight", GGMLQuantizationType.IQ4_NL)
    return path


def test_a_tensor_type_the_kernels_lack_is_refused_when_loading_naming_tensor_and_type(iq_file):
    with pytest.raises(UnsupportedTensor, match=r"blk\.1\.ffn_down\.weight is IQ4_NL"):
        load_model(str(iq_file))


def test_a_tensor_type_the_kernels_lack_is_listed_with_the_reason_it_is_refused(iq_file, tmp_path):
    registry = ModelRegistry([iq_file], home=tmp_path / "home", hf_hub=tmp_path / "hub")
    entry = registry.get("tiny-iq")
    assert entry is not None and entry.refusal is not None
    assert "blk.1.ffn_down.weight is IQ4_NL" in entry.refusal


def test_a_gguf_without_tensors_reads_as_its_fields_alone(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "header.gguf", "clip")
    writer.add_clip_projector_type("gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fields, tensors = read_header(tmp_path / "header.gguf")
    assert fields["clip.projector_type"] == "gemma3" and tensors == []
