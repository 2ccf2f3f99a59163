"""Llama-shaped GGUF files with random weights and SmolLM2's real tokenizer (issue 26).

    python benchmarks/synthetic_gguf.py --shape {tiny,1b,3b,8b,30b-a3b} --type Q4_K_M -o FILE
                                        [--layers N] [--seed S]

What a model costs to load, hold and run (memory, load time, bytes read a token) depends on its
shapes and quantization, not on what its weights learned, so these files stand in for the
checkpoints no machine here can download. Shapes are Llama 3.x's with SmolLM2's vocabulary
(49152) and every `tokenizer.*` field of the embedded SmolLM2 GGUF, so both modelhost and
llama.cpp tokenize and template chats as they would for a real model; context 8192 (SmolLM2's;
Llama 3.2's 131072 only changes the metadata) and rope theta 500000, without Llama 3.1's rope
scaling tensor. Weights are random at an initialised model's spread (std 0.02, norms ~1):
quantized tensors are random blocks written directly in ggml's layouts (synthetic_blocks.py),
F32/F16/BF16 ones Gaussian.

Types: `Q4_K_M` and `Q5_K_M` are llama.cpp's mixtures (`mixture_types`); every other type puts
every 2-D weight, embedding and output included, in that one type (llama.cpp's own Q4_0, Q2_K,
Q3_K_S ... files would bump the output to Q6_K and more); norms are F32 always. The file is
written tensor by tensor, in chunks of rows, so an 8B file never sits in memory.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    TokenType,
)
from gguf.quants import quantize

sys.path.append(str(Path(__file__).resolve().parent))  # its sibling modules, shadowing nothing
from gguf_metadata import Field, read_fields  # noqa: E402
from synthetic_blocks import BLOCK_TYPES, random_blocks  # noqa: E402

Q = GGMLQuantizationType
WEIGHT_STD = 0.02  # an initialised Llama's (initializer_range)
NORM_STD = 0.02  # norms are 1 + this much noise
CHUNK_ELEMENTS = 1 << 24  # rows generated and written together, ~16M weights at a time
TOKENIZER_SOURCE = "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool  # the output projection is the token embedding (no output.weight)
    vocab: int = 49152
    context: int = 8192
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    # A mixture of experts (Qwen3-MoE, GGUF `qwen3moe`): every layer's MLP is `experts` SwiGLU
    # experts of width `expert_ffn`, `experts_used` a token, behind a router; q/k norms.
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    # Gemma 3 (GGUF `gemma3`): q/k norms, norms after attention and after the MLP, sliding
    # windows of this many tokens in five layers of six (llama.cpp's rule for the architecture)
    gemma3_window: int = 0

    @property
    def architecture(self) -> str:
        if self.gemma3_window:
            return "gemma3"
        return "qwen3moe" if self.experts else "llama"


# Llama 3.2 1B / 3B and Llama 3.1 8B, with SmolLM2's vocabulary; `tiny` is the narrowest shape
# whose widths are all multiples of 256, which K-quant blocks need.
SHAPES = {
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, tied=True),
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, tied=True),
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, ffn=8192, tied=True),
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, tied=False),
    # Qwen3-30B-A3B: 128 experts of 768, 8 a token (3.3B of its 30.5B parameters active a token)
    "30b-a3b": Shape(
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        ffn=6144,
        tied=False,
        rope_theta=1_000_000.0,
        rms_eps=1e-6,
        experts=128,
        experts_used=8,
        expert_ffn=768,
    ),  # fmt: skip
}


@dataclass(frozen=True, slots=True)
class Mixture:
    base: GGMLQuantizationType  # every 2-D weight not named below
    more_bits: GGMLQuantizationType | None  # llama.cpp's "more bits" attn_v/ffn_down, output
    file_type: int  # general.file_type, llama.cpp's LLAMA_FTYPE_*


F = LlamaFileType
# Uniform K types have no llama.cpp file type of their own; they carry the nearest mixture's
# (Q4_K -> Q4_K_S ...), which llama.cpp only prints.
MIXTURES = {
    "Q4_K_M": Mixture(Q.Q4_K, Q.Q6_K, F.MOSTLY_Q4_K_M),
    "Q5_K_M": Mixture(Q.Q5_K, Q.Q6_K, F.MOSTLY_Q5_K_M),
    "Q6_K": Mixture(Q.Q6_K, None, F.MOSTLY_Q6_K),
    "Q8_0": Mixture(Q.Q8_0, None, F.MOSTLY_Q8_0),
    "Q4_0": Mixture(Q.Q4_0, None, F.MOSTLY_Q4_0),
    "Q4_1": Mixture(Q.Q4_1, None, F.MOSTLY_Q4_1),
    "Q5_0": Mixture(Q.Q5_0, None, F.MOSTLY_Q5_0),
    "Q5_1": Mixture(Q.Q5_1, None, F.MOSTLY_Q5_1),
    "Q2_K": Mixture(Q.Q2_K, None, F.MOSTLY_Q2_K),
    "Q3_K": Mixture(Q.Q3_K, None, F.MOSTLY_Q3_K_S),
    "Q4_K": Mixture(Q.Q4_K, None, F.MOSTLY_Q4_K_S),
    "Q5_K": Mixture(Q.Q5_K, None, F.MOSTLY_Q5_K_S),
    "F16": Mixture(Q.F16, None, F.MOSTLY_F16),
    "BF16": Mixture(Q.BF16, None, F.MOSTLY_BF16),
    "F32": Mixture(Q.F32, None, F.ALL_F32),
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    rows: int  # output features (ggml's ne[1]); 1 for a norm
    cols: int  # input width (ne[0]), the dimension blocks run along
    qtype: GGMLQuantizationType
    norm: bool = False
    experts: int = 0  # a mixture of experts' 3-D tensor: [experts, rows, cols]

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return max(1, self.experts) * self.rows * self.cols // block * size

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """numpy's shape of the raw bytes, as GGUFWriter.add_tensor_info takes it."""
        row_bytes = self.nbytes // self.rows // max(1, self.experts)
        if self.norm:
            return (row_bytes,)
        return (self.experts, self.rows, row_bytes) if self.experts else (self.rows, row_bytes)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of layers for more bits (src/llama-quant.cpp): the first and last
    eighth, and every third layer in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def mixture_types(kind: str, layer: int | None, layers: int, mixture: Mixture, tied: bool):
    """The type llama.cpp's quantizer gives weight `kind` (of layer `layer`) in a Q4_K_M /
    Q5_K_M file of a dense Llama, or `mixture.base` for a uniform type:
    - the output projection (output.weight, or token_embd.weight when tied) in Q6_K;
    - attn_v and ffn_down in Q6_K in the layers `use_more_bits` picks (a mixture of experts'
      ffn_down_exps too);
    - everything else, an untied token_embd included, in the base type."""
    if mixture.more_bits is None:
        return mixture.base
    if kind == "output" or (kind == "token_embd" and tied):
        return mixture.more_bits
    if (
        kind in ("attn_v", "ffn_down", "ffn_down_exps")
        and layer is not None
        and use_more_bits(layer, layers)
    ):
        return mixture.more_bits
    return mixture.base


def tensor_plan(shape: Shape, qtype: str) -> list[TensorSpec]:
    """Every tensor of the file in llama.cpp's order (that of its converted Llama GGUFs)."""
    mixture = MIXTURES[qtype]
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def weight(name: str, kind: str, layer: int | None, rows: int, cols: int) -> TensorSpec:
        qtype = mixture_types(kind, layer, shape.layers, mixture, shape.tied)
        if cols % GGML_QUANT_SIZES[qtype][0]:
            raise ValueError(f"{name}: width {cols} is not a multiple of {qtype.name}'s block")
        return TensorSpec(name, rows, cols, qtype)

    def norm(name: str, width: int = shape.hidden) -> TensorSpec:
        return TensorSpec(name, 1, width, Q.F32, norm=True)

    def experts(name: str, kind: str, layer: int, rows: int, cols: int) -> TensorSpec:
        spec = weight(name, kind, layer, rows, cols)
        return replace(spec, experts=shape.experts)

    plan = [weight("token_embd.weight", "token_embd", None, shape.vocab, shape.hidden)]
    for i in range(shape.layers):
        blk = f"blk.{i}."
        if shape.experts:  # llama.cpp keeps the router in F32, as it keeps norms
            plan += [
                norm(blk + "attn_norm.weight"),
                experts(
                    blk + "ffn_down_exps.weight", "ffn_down_exps", i, shape.hidden, shape.expert_ffn
                ),
                experts(
                    blk + "ffn_gate_exps.weight", "ffn_gate_exps", i, shape.expert_ffn, shape.hidden
                ),
                TensorSpec(blk + "ffn_gate_inp.weight", shape.experts, shape.hidden, Q.F32),
                experts(
                    blk + "ffn_up_exps.weight", "ffn_up_exps", i, shape.expert_ffn, shape.hidden
                ),
                norm(blk + "ffn_norm.weight"),
                weight(blk + "attn_k.weight", "attn_k", i, kv_width, shape.hidden),
                norm(blk + "attn_k_norm.weight", shape.head_dim),
                weight(blk + "attn_output.weight", "attn_output", i, shape.hidden, q_width),
                weight(blk + "attn_q.weight", "attn_q", i, q_width, shape.hidden),
                norm(blk + "attn_q_norm.weight", shape.head_dim),
                weight(blk + "attn_v.weight", "attn_v", i, kv_width, shape.hidden),
            ]
            continue
        plan += [
            norm(blk + "attn_norm.weight"),
            weight(blk + "ffn_down.weight", "ffn_down", i, shape.hidden, shape.ffn),
            weight(blk + "ffn_gate.weight", "ffn_gate", i, shape.ffn, shape.hidden),
            weight(blk + "ffn_up.weight", "ffn_up", i, shape.ffn, shape.hidden),
            norm(blk + "ffn_norm.weight"),
            weight(blk + "attn_k.weight", "attn_k", i, kv_width, shape.hidden),
            weight(blk + "attn_output.weight", "attn_output", i, shape.hidden, q_width),
            weight(blk + "attn_q.weight", "attn_q", i, q_width, shape.hidden),
            weight(blk + "attn_v.weight", "attn_v", i, kv_width, shape.hidden),
        ]
        if shape.gemma3_window:
            plan += [
                norm(blk + "attn_k_norm.weight", shape.head_dim),
                norm(blk + "attn_q_norm.weight", shape.head_dim),
                norm(blk + "post_attention_norm.weight"),
                norm(blk + "post_ffw_norm.weight"),
            ]
    plan.append(norm("output_norm.weight"))
    if not shape.tied:
        plan.append(weight("output.weight", "output", None, shape.vocab, shape.hidden))
    return plan


def tensor_chunks(spec: TensorSpec, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The tensor's bytes, a few million weights at a time."""
    if spec.norm:
        values = 1.0 + NORM_STD * rng.standard_normal(spec.cols, dtype=np.float32)
        yield values.astype("<f4").view(np.uint8)
        return
    block = GGML_QUANT_SIZES[spec.qtype][0]
    rows_per_chunk = max(1, CHUNK_ELEMENTS // spec.cols)
    all_rows = max(1, spec.experts) * spec.rows
    for start in range(0, all_rows, rows_per_chunk):
        rows = min(rows_per_chunk, all_rows - start)
        if spec.qtype in BLOCK_TYPES:
            yield random_blocks(spec.qtype, rows * spec.cols // block, WEIGHT_STD, rng)
            continue
        values = WEIGHT_STD * rng.standard_normal((rows, spec.cols), dtype=np.float32)
        if spec.qtype == Q.F32:
            yield values.view(np.uint8)
        elif spec.qtype == Q.F16:
            yield values.astype("<f2").view(np.uint8)
        else:  # BF16: gguf rounds to nearest even
            yield quantize(values, spec.qtype)


@functools.cache
def tokenizer_fields(source: str = TOKENIZER_SOURCE) -> tuple[Field, ...]:
    """Every `tokenizer.*` field of an embedded model's GGUF, in its order."""
    from modelhost.models.loading.embedded import embedded_path

    return tuple(f for f in read_fields(embedded_path(source)) if f.key.startswith("tokenizer."))


def add_metadata(
    writer: GGUFWriter,
    shape: Shape,
    shape_name: str,
    qtype: str,
    tokenizer: bool,
    added_tokens: tuple[str, ...] = (),
) -> None:
    writer.add_type("model")
    family = {"qwen3moe": "Qwen3-MoE", "gemma3": "Gemma 3"}.get(shape.architecture, "Llama")
    writer.add_name(f"Synthetic {family} {shape_name} {qtype}")
    writer.add_description(
        "Random weights (benchmarks/synthetic_gguf.py): for measuring cost, not quality"
    )
    writer.add_file_type(int(MIXTURES[qtype].file_type))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_vocab_size(shape.vocab)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.gemma3_window:
        writer.add_sliding_window(shape.gemma3_window)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    for field in tokenizer_fields() if tokenizer else ():
        sub_type = field.types[1] if len(field.types) > 1 else None
        value = field.value
        if field.key == "tokenizer.ggml.tokens":
            value = [*value, *added_tokens]
        elif field.key == "tokenizer.ggml.token_type":
            value = [*value, *[TokenType.CONTROL] * len(added_tokens)]
        writer.add_key_value(field.key, value, field.types[0], sub_type=sub_type)


def write_synthetic_gguf(
    path: str | Path,
    shape: str | Shape,
    qtype: str,
    *,
    seed: int = 0,
    layers: int | None = None,
    tokenizer: bool = True,
    added_tokens: tuple[str, ...] = (),
    progress: bool = False,
) -> Path:
    """Write a Llama-shaped GGUF (or Qwen3-MoE's, Gemma 3's: the Shape says) of `shape` (a name
    in SHAPES, or a Shape) in `qtype` (a name in MIXTURES) to `path`; `layers` overrides the
    shape's block count. Same seed, same bytes.
    `tokenizer=False` leaves the tokenizer out (for tests of the tensors alone);
    `added_tokens` follow SmolLM2's vocabulary as control tokens (a vision model's image
    tokens; the shape's vocab must count them)."""
    shape_name = shape if isinstance(shape, str) else "custom"
    dims = SHAPES[shape] if isinstance(shape, str) else shape
    if layers is not None:
        dims = replace(dims, layers=layers)
    plan = tensor_plan(dims, qtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    # GGUFWriter writes the header, metadata and tensor table; the data section is appended
    # here, chunk by chunk, at the offsets that table promised (each tensor padded to the
    # alignment), since the writer only takes whole tensors.
    writer = GGUFWriter(path, dims.architecture)
    add_metadata(writer, dims, shape_name, qtype, tokenizer, added_tokens)
    for spec in plan:
        writer.add_tensor_info(
            spec.name, spec.byte_shape, np.dtype(np.uint8), spec.nbytes, raw_dtype=spec.qtype
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    align = writer.data_alignment

    total = sum(spec.nbytes for spec in plan)
    done = 0
    with open(path, "ab") as out:
        out.write(bytes(-out.tell() % align))
        for index, spec in enumerate(plan):
            rng = np.random.default_rng([seed, index])
            written = 0
            for chunk in tensor_chunks(spec, rng):
                out.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
                written += chunk.nbytes
            assert written == spec.nbytes, (spec.name, written, spec.nbytes)
            out.write(bytes(-written % align))
            done += written
            if progress:
                print(f"\r{done / total:6.1%}  {spec.name:<28}", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--type", dest="qtype", choices=list(MIXTURES), required=True)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=None, help="override the block count")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    path = write_synthetic_gguf(
        args.output, args.shape, args.qtype, seed=args.seed, layers=args.layers, progress=True
    )
    elapsed = time.perf_counter() - started
    size = path.stat().st_size
    print(f"wrote {path}: {size / 1e9:.3f} GB ({size:,} bytes) in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
