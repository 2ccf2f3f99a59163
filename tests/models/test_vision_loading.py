"""How vision models are found and loaded: a SmolVLM folder lists as supported and reads
images; a GGUF reads images when an mmproj we compute sits beside it (which is then no model of
its own) or is named; the tower runs on the native kernels; and image rows enter the decoder's
embeddings on every path, the fused one-token step included."""

from __future__ import annotations

import logging
import shutil

import gguf
import pytest
import torch
from test_vision_parity import PROMPT, logits_with_image, our_ids, random_image
from tiny_vision import (
    make_tiny_smolvlm,
    reference_processor,
    reference_smolvlm,
    write_smolvlm_gguf,
)

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.scheduler import ScheduledRow, SchedulerOutput
from modelhost.engine.sequence import Sequence
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.models.vision.load import UnsupportedProjector
from modelhost.residency.model_facts import model_facts
from modelhost.residency.registry import ModelRegistry


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2):
    return make_tiny_smolvlm(tmp_path_factory.mktemp("smolvlm") / "tiny-smolvlm", smollm2)


@pytest.fixture(scope="module")
def pair(folder):
    """The GGUF text model (its mmproj beside it)."""
    return write_smolvlm_gguf(folder, folder.parent / "gguf")


@pytest.fixture(scope="module")
def reference(folder):
    return reference_smolvlm(folder), reference_processor(folder)


def test_registry_lists_a_smolvlm_folder_as_a_servable_vision_model(folder, tmp_path):
    registry = ModelRegistry([folder.parent], home=tmp_path / "home", hf_hub=tmp_path / "hub")
    entry = registry.get("tiny-smolvlm")
    assert entry is not None and entry.refusal is None
    assert model_facts(entry).vision


def test_registry_lists_a_gguf_and_its_mmproj_as_one_vision_model(pair, tmp_path):
    registry = ModelRegistry([pair.parent], home=tmp_path / "home", hf_hub=tmp_path / "hub")
    ids = [entry.id for entry in registry.entries()]
    assert "tiny-smolvlm" in ids
    assert not any(i.startswith("mmproj") for i in ids)
    entry = registry.get("tiny-smolvlm")
    assert entry is not None and entry.refusal is None
    assert model_facts(entry).vision
    mmproj = pair.parent / "mmproj-tiny-smolvlm.gguf"
    assert entry.size_bytes >= pair.stat().st_size + mmproj.stat().st_size


def test_a_gguf_alone_reads_no_images(pair, tmp_path):
    alone = tmp_path / "alone.gguf"
    shutil.copy(pair, alone)
    model = load_model(str(alone), quantize="none")
    assert model.vision is None and not model.family.vision
    registry = ModelRegistry([tmp_path], home=tmp_path / "home", hf_hub=tmp_path / "hub")
    entry = registry.get("alone")
    assert entry is not None and not model_facts(entry).vision


def test_a_named_mmproj_gives_a_gguf_its_tower(pair, tmp_path):
    alone = tmp_path / "alone.gguf"
    shutil.copy(pair, alone)
    model = load_model(str(alone), quantize="none", mmproj=pair.parent / "mmproj-tiny-smolvlm.gguf")
    assert model.vision is not None and model.family.vision


def _other_projector(source, path):
    """A copy of the mmproj whose projector type says something we do not compute."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_clip_projector_type("qwen2vl_merger")
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_mmproj_we_cannot_compute_leaves_the_model_text_only(pair, tmp_path, caplog):
    model_path = tmp_path / "model.gguf"
    shutil.copy(pair, model_path)
    mmproj = _other_projector(pair.parent / "mmproj-tiny-smolvlm.gguf", tmp_path / "mmproj-x.gguf")
    with caplog.at_level(logging.WARNING):
        model = load_model(str(model_path), quantize="none")
    assert model.vision is None and not model.family.vision
    assert "mmproj-x.gguf" in caplog.text and "qwen2vl_merger" in caplog.text
    with pytest.raises(UnsupportedProjector, match="qwen2vl_merger"):
        load_model(str(model_path), quantize="none", mmproj=mmproj)


def test_tower_on_the_native_kernels_agrees_with_transformers(pair, reference):
    network, processor = reference
    ours = load_model(str(pair), quantize="auto")  # F32 tiles, activations rounded to 16 bits
    image = random_image(120, 200)
    inputs = processor(text=[PROMPT], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        expected = network(**inputs).logits[0]
    ids, rows = our_ids(ours, PROMPT, image)
    got = logits_with_image(ours, ids, rows)
    # Observed 0.065 (the logits reach 13): activations rounded to 16 bits in the tower's
    # linears as in the decoder's, through twice the layers the text-only check has.
    assert torch.allclose(got, expected, atol=0.1, rtol=0)


def test_q8_0_mmproj_tower_stays_close_to_transformers(folder, reference, tmp_path):
    network, processor = reference
    ours = load_model(str(write_smolvlm_gguf(folder, tmp_path / "q8", "Q8_0")))
    image = random_image(200, 120)
    inputs = processor(text=["<image>"], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        features = network.model.get_image_features(
            inputs["pixel_values"], inputs["pixel_attention_mask"]
        ).pooler_output
    expected = torch.cat(list(features))
    _, rows = our_ids(ours, "<image>", image)
    # Observed 0.8% (a relative error of the whole output): 8-bit weights, 16-bit activations.
    assert (rows - expected).norm() / expected.norm() < 0.02


def test_f16_mmproj_tower_stays_close_to_transformers(folder, reference, tmp_path):
    network, processor = reference
    ours = load_model(str(write_smolvlm_gguf(folder, tmp_path / "f16", "F16")))
    image = random_image(200, 120)
    inputs = processor(text=["<image>"], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        features = network.model.get_image_features(
            inputs["pixel_values"], inputs["pixel_attention_mask"]
        ).pooler_output
    expected = torch.cat(list(features))
    _, rows = our_ids(ours, "<image>", image)
    # Observed 0.4%: 16-bit weights and activations (bf16 on PyTorch's GEMM where the CPU has
    # bf16 dot products, models/loading/quant.py's Bf16Linear), fp32 sums.
    error = (rows.float() - expected).norm() / expected.norm()
    assert error < 0.02, error


def _last_prompt_token_logits(
    model: LoadedModel, ids: list[int], row: torch.Tensor | None, fused: bool
) -> torch.Tensor:
    """The prompt prefilled but for its last token, then that token alone in a step of its
    own (the one-token step the fused path takes), its embedding overwritten by `row`."""
    model.network.fuse_decode = fused
    engine = Engine(model, EngineConfig(batch=1))
    try:
        seq = Sequence.from_prompt(0, ids, SamplingParams())
        engine.block_manager.append_slots(seq, len(ids))
        kv = engine.runner.kv
        first = engine.runner.build_batch(
            SchedulerOutput(rows=[ScheduledRow(seq, 0, len(ids) - 1, False)])
        )
        model.network(first, kv)
        step = engine.runner.build_batch(
            SchedulerOutput(rows=[ScheduledRow(seq, len(ids) - 1, 1, True)])
        )
        fused_path = model.network.fused_decode()
        assert (fused_path is not None and fused_path.can_run(step, kv)) == fused
        if row is not None:
            step.embed_override = (torch.tensor([0]), row[None])
        return model.network(step, kv)[0]
    finally:
        model.network.fuse_decode = True
        engine.close()


def test_image_rows_enter_the_fused_one_token_step(pair):
    model = load_model(str(pair), quantize="auto")
    assert model.vision is not None
    ids, rows = our_ids(model, "A picture: <image>", random_image(64, 64))
    ids = ids[: ids.index(model.vision.image_token_id) + 1]  # ends on the first placeholder
    fused = _last_prompt_token_logits(model, ids, rows[0], fused=True)
    unfused = _last_prompt_token_logits(model, ids, rows[0], fused=False)
    plain = _last_prompt_token_logits(model, ids, None, fused=True)
    assert torch.allclose(fused, unfused, atol=0.02, rtol=0)
    assert not torch.allclose(fused, plain, atol=0.02, rtol=0)


def test_a_named_mmproj_elsewhere_makes_the_registry_list_a_vision_model(pair, tmp_path):
    """`serve --mmproj FILE`: the GGUF alone in its folder, its projector named from another."""
    model_path = tmp_path / "alone" / "model.gguf"
    model_path.parent.mkdir()
    shutil.copy(pair, model_path)
    mmproj = pair.parent / "mmproj-tiny-smolvlm.gguf"
    registry = ModelRegistry([], home=tmp_path / "home", hf_hub=tmp_path / "hub")
    plain = registry.resolve_argument(str(model_path))
    assert plain is not None and not model_facts(plain).vision
    named = registry.resolve_argument(str(model_path), mmproj)
    assert named is not None and named.mmproj == mmproj.resolve()
    assert model_facts(named).vision
    assert named.size_bytes == plain.size_bytes + mmproj.stat().st_size
