"""The ctypes mirrors of the structs the native kernels read, in one place: the library reports
each struct's size (`mh_struct_size`, in STRUCTS' order) and `native.check_struct_sizes` compares
them with these when it loads, so a field changed on one side only is refused there."""

from __future__ import annotations

import ctypes

_i64, _ptr, _f32, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int32


class QLinearDesc(ctypes.Structure):
    """native_qlinear.h's QLinear: a packed weight (kernels/packed.py) as the kernels read it."""

    _fields_ = [
        ("format", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("data", ctypes.c_void_p),
        ("params", ctypes.c_void_p),
        ("supers", ctypes.c_void_p),
        ("out", ctypes.c_int64),
        ("padded", ctypes.c_int64),
    ]


class NativeMoE(ctypes.Structure):
    """native_moe.h's NativeMoE."""

    _fields_ = [
        ("router", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("norm_topk", ctypes.c_int32),
        ("act", ctypes.c_int32),
    ]


class NativeLinear(ctypes.Structure):
    _fields_ = [
        ("parts", QLinearDesc * 3),
        ("count", _i64),
        ("out", _i64),
        ("bias", _ptr),
    ]


class NativeLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", NativeLinear),
        ("o", NativeLinear),
        ("gate_up", NativeLinear),
        ("down", NativeLinear),
        ("input_norm", _ptr),
        ("attention_out_norm", _ptr),
        ("mlp_in_norm", _ptr),
        ("mlp_out_norm", _ptr),
        ("qk_norm", _ptr),
        ("eps", _f32),
        ("qk_eps", _f32),
        ("scale", _f32),
        ("softcap", _f32),
        ("residual_scale", _f32),
        ("act", _i32),
        ("rope", _i32),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("dim", _i64),
        ("window", _i64),
        ("moe", _ptr),  # a mixture of experts' NativeMoE (models/networks/moe.py), else null
    ]


class NativeLoraTarget(ctypes.Structure):
    """native_lora.h's NativeLoraTarget: a target's output columns in its host, its rank
    columns of the stack, and its B transposed (bf16 [ranks, stop - start])."""

    _fields_ = [
        ("start", _i64),
        ("stop", _i64),
        ("first", _i64),
        ("ranks", _i64),
        ("b", _ptr),
    ]


class NativeLora(ctypes.Structure):
    """native_lora.h's NativeLora: a host module's stacked updates for a step (a null `a`:
    none)."""

    _fields_ = [
        ("a", _ptr),  # bf16 [ranks, in]
        ("mask", _ptr),  # fp32 [rows, ranks]
        ("targets", _ptr),  # NativeLoraTarget [count]
        ("count", _i64),
        ("ranks", _i64),
        ("in_features", _i64),
    ]


class NativeStep(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("width", _i64),
        ("cos", _ptr * 3),  # the layers' rotary tables, by NativeLayer.rope
        ("sin", _ptr * 3),
        ("pools", _ptr),
        ("pool_kind", _i32),  # native.pool_kind's
        ("slots", _ptr),
        ("blocks", _ptr),
        ("positions", _ptr),
        ("blocks_per_row", _i64),
        ("block_size", _i64),
        ("threads", _i32),
        ("lora", _ptr),  # NativeLora [layers][4] (qkv, o, gate_up, down), or null: none
    ]


# native_kernels.cpp's mh_struct_size(which) reports the size of STRUCTS[which].
STRUCTS: tuple[type[ctypes.Structure], ...] = (
    QLinearDesc,
    NativeMoE,
    NativeLinear,
    NativeLayer,
    NativeStep,
    NativeLora,
    NativeLoraTarget,
)
