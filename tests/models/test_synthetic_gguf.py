"""benchmarks/synthetic_gguf.py: Llama-shaped GGUF files that gguf's own reader reads back."""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from modelhost.models.loading.embedded import embedded_path

# Appended, not prepended: benchmarks/ holds engine.py, step.py ... which must shadow nothing.
sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))
synthetic_gguf = importlib.import_module("synthetic_gguf")
gguf_metadata = importlib.import_module("gguf_metadata")

Q = gguf.GGMLQuantizationType
TYPES = list(synthetic_gguf.MIXTURES)
# The tiny shape with a narrow vocabulary and no tokenizer: a 49152-row embedding in every type
# would take most of these tests' time and check nothing more.
NARROW = replace(synthetic_gguf.SHAPES["tiny"], vocab=1024)
# Its tensors as ggml lists dimensions (input width first).
TINY_SHAPES = {
    "token_embd": [256, 1024],
    "attn_norm": [256],
    "ffn_down": [512, 256],
    "ffn_gate": [256, 512],
    "ffn_up": [256, 512],
    "ffn_norm": [256],
    "attn_k": [256, 128],
    "attn_output": [256, 256],
    "attn_q": [256, 256],
    "attn_v": [256, 128],
    "output_norm": [256],
}
# Layers whose attn_v and ffn_down llama.cpp's Q4_K_M/Q5_K_M put in Q6_K (use_more_bits in
# src/llama-quant.cpp: the first and last eighth, and every third layer from n/8 + 2), by hand.
MORE_BITS_LAYERS = {
    2: {1},
    16: {0, 1, 4, 7, 10, 13, 14, 15},
    28: {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27},
    32: {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31},
}


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """narrow(qtype, layers=None): gguf's reader over a NARROW file of that type, written once."""
    root = tmp_path_factory.mktemp("synthetic")
    readers: dict[tuple[str, int | None], gguf.GGUFReader] = {}

    def read(qtype: str, layers: int | None = None) -> gguf.GGUFReader:
        if (qtype, layers) not in readers:
            path = synthetic_gguf.write_synthetic_gguf(
                root / f"{qtype}-{layers}.gguf", NARROW, qtype, layers=layers, tokenizer=False
            )
            readers[qtype, layers] = gguf.GGUFReader(path)
        return readers[qtype, layers]

    return read


def kind(name: str) -> str:
    return name.removesuffix(".weight").split(".")[-1]


def q6_k_tensors(names_and_types) -> set[str]:
    return {name for name, qtype in names_and_types if qtype == Q.Q6_K}


def expected_q6_k(layers: int, tied: bool) -> set[str]:
    more = MORE_BITS_LAYERS[layers]
    names = {f"blk.{i}.{k}.weight" for i in more for k in ("attn_v", "ffn_down")}
    return names | {"token_embd.weight" if tied else "output.weight"}


@pytest.mark.parametrize("qtype", TYPES)
def test_every_type_writes_a_file_gguf_reads_with_llamas_tensor_names_and_shapes(narrow, qtype):
    reader = narrow(qtype)
    assert len(reader.tensors) == 1 + 2 * 9 + 1  # tied: no output.weight
    for tensor in reader.tensors:
        assert tensor.shape.tolist() == TINY_SHAPES[kind(tensor.name)], tensor.name


@pytest.mark.parametrize("qtype", [t for t in TYPES if not t.endswith("_M")])
def test_a_plain_type_puts_every_weight_in_it_and_the_norms_in_f32(narrow, qtype):
    for tensor in narrow(qtype).tensors:
        expected = Q.F32 if kind(tensor.name).endswith("norm") else Q[qtype]
        assert tensor.tensor_type == expected, tensor.name


@pytest.mark.parametrize("qtype", TYPES)
def test_every_weight_dequantizes_with_gguf_to_finite_values_at_an_initialised_models_spread(
    narrow, qtype
):
    for tensor in narrow(qtype).tensors:
        values = gguf.quants.dequantize(tensor.data[:256], tensor.tensor_type)
        assert np.isfinite(values).all(), tensor.name
        if kind(tensor.name).endswith("norm"):
            assert abs(values.mean() - 1) < 0.01 and values.std() < 0.05, tensor.name
        else:
            assert 0.018 < values.std() < 0.022, (tensor.name, values.std())
            assert abs(values.mean()) < 0.15 * values.std(), (tensor.name, values.mean())


@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q5_K_M"])
def test_a_k_m_file_puts_q6_k_where_llama_cpp_does_and_the_base_k_type_elsewhere(narrow, qtype):
    reader = narrow(qtype, layers=16)
    q6 = q6_k_tensors((t.name, t.tensor_type) for t in reader.tensors)
    assert q6 == expected_q6_k(16, tied=True)
    base = Q.Q4_K if qtype == "Q4_K_M" else Q.Q5_K
    rest = {t.tensor_type for t in reader.tensors if t.name not in q6}
    assert rest == {base, Q.F32}


@pytest.mark.parametrize("shape", ["tiny", "1b", "3b", "8b"])
def test_the_q4_k_m_plan_of_each_shape_follows_llama_cpps_rule(shape):
    dims = synthetic_gguf.SHAPES[shape]
    plan = synthetic_gguf.tensor_plan(dims, "Q4_K_M")
    assert q6_k_tensors((s.name, s.qtype) for s in plan) == expected_q6_k(dims.layers, dims.tied)


def test_an_untied_q4_k_m_embedding_stays_q4_k_beside_a_q6_k_output():
    plan = {
        s.name: s.qtype for s in synthetic_gguf.tensor_plan(synthetic_gguf.SHAPES["8b"], "Q4_K_M")
    }
    assert (plan["token_embd.weight"], plan["output.weight"]) == (Q.Q4_K, Q.Q6_K)


def test_the_metadata_carries_llama_cpps_hyperparameter_keys(narrow):
    fields = narrow("Q4_K_M").fields
    expected = {
        "general.architecture": "llama",
        "general.file_type": 15,  # LLAMA_FTYPE_MOSTLY_Q4_K_M
        "llama.vocab_size": 1024,
        "llama.context_length": 8192,
        "llama.embedding_length": 256,
        "llama.block_count": 2,
        "llama.feed_forward_length": 512,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 64,
        "llama.rope.freq_base": 500000.0,
    }
    assert {key: fields[key].contents() for key in expected} == expected
    assert fields["llama.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(1e-5)


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_weights(tmp_path):
    def write(name: str, seed: int) -> bytes:
        path = tmp_path / name
        synthetic_gguf.write_synthetic_gguf(path, NARROW, "Q4_K", seed=seed, tokenizer=False)
        return path.read_bytes()

    first, again, other = write("a", 0), write("b", 0), write("c", 1)
    assert first == again
    assert len(other) == len(first) and other != first


def test_the_tokenizer_fields_are_smollm2s_own_byte_for_byte(tmp_path):
    path = synthetic_gguf.write_synthetic_gguf(tmp_path / "t.gguf", "tiny", "Q8_0")
    fields = synthetic_gguf.tokenizer_fields()
    smollm2 = Path(embedded_path(synthetic_gguf.TOKENIZER_SOURCE)).read_bytes()
    written = path.read_bytes()
    assert {"tokenizer.ggml.tokens", "tokenizer.chat_template"} <= {f.key for f in fields}
    for field in fields:  # decoded, then encoded again by gguf's writer: the same bytes
        assert smollm2[field.start : field.end] in written, field.key


def test_the_metadata_reader_reads_what_ggufs_reader_reads(tmp_path):
    path = synthetic_gguf.write_synthetic_gguf(
        tmp_path / "m.gguf", NARROW, "Q4_K_M", tokenizer=False
    )
    ours = {f.key: (f.value, list(f.types)) for f in gguf_metadata.read_fields(path)}
    theirs = gguf.GGUFReader(path).fields.items()
    assert ours == {
        k: (f.contents(), list(f.types)) for k, f in theirs if not k.startswith("GGUF.")
    }


def test_the_30b_a3b_plan_has_qwen3moe_experts_in_llama_cpps_q4_k_m_types():
    shape = synthetic_gguf.SHAPES["30b-a3b"]
    plan = {spec.name: spec for spec in synthetic_gguf.tensor_plan(shape, "Q4_K_M")}
    gate, down = plan["blk.0.ffn_gate_exps.weight"], plan["blk.7.ffn_down_exps.weight"]
    assert (gate.experts, gate.rows, gate.cols, gate.qtype) == (128, 768, 2048, Q.Q4_K)
    assert gate.byte_shape == (128, 768, 2048 // 256 * 144)
    assert plan["blk.0.ffn_down_exps.weight"].qtype == Q.Q6_K  # use_more_bits: 0, not 7
    assert (down.experts, down.rows, down.cols, down.qtype) == (128, 2048, 768, Q.Q4_K)
    router = plan["blk.0.ffn_gate_inp.weight"]
    assert (router.rows, router.cols, router.qtype) == (128, 2048, Q.F32)
    assert plan["blk.0.attn_q_norm.weight"].cols == 128
    assert "blk.0.ffn_gate.weight" not in plan
    # Qwen3-30B-A3B's Q4_K_M is 18.6 GB with its own vocabulary (151936 tokens: ~0.3 GB more)
    assert 18.0e9 < sum(spec.nbytes for spec in plan.values()) < 18.6e9


def test_a_gemma3_shape_writes_a_gemma3_file_our_loader_reads_with_its_windows(tmp_path):
    """Gemma 3's extra norms (q/k, after attention, after the MLP) and its sliding window, as
    llama.cpp's converter writes them; the loader builds the family from it."""
    from modelhost.models.loading.loader import load_model

    shape = replace(synthetic_gguf.SHAPES["tiny"], gemma3_window=64)  # with SmolLM2's tokenizer
    path = synthetic_gguf.write_synthetic_gguf(tmp_path / "gemma3.gguf", shape, "Q8_0")
    reader = gguf.GGUFReader(path)
    names = {tensor.name for tensor in reader.tensors}
    for norm in ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"):
        assert f"blk.1.{norm}.weight" in names
    model = load_model(str(path), quantize="none")
    assert model.family.name == "gemma3" and model.config.sliding_window == 64
