// The 8-bit KV cache's slots (`--kv-cache q8`, models/kv_q8.py) for the paged attention kernels:
// a head's key or value is dim int8 values in groups of 32 (one group where dim is no multiple
// of 32), then a bf16 scale a group (kv_q8_layout.py). The store writes kv_q8.quantize's bytes
// exactly (the same fp32 operations in the same order: a group's largest magnitude / 127
// rounded to bf16, each value divided by that rounded scale, rounded half to even, clamped to
// +-127), so a block is the same whether the kernels or PyTorch wrote it. Attention reads a
// chunk of 16 values as fp32 (int8 times its group's scale, exactly as kv_q8.dequantize) and
// goes on as over an fp32 pool: fp32 products and sums. Included by native_kernels.cpp after
// native_common.h, inside its target region.

#pragma once

namespace {

// What a pool holds, mh_paged_attention's `kind` (models/kernels/native.py's pool_kind).
enum PoolKind : int { kPoolF32 = 0, kPoolF16 = 1, kPoolQ8 = 2 };

constexpr int64_t kQ8Group = 32;  // kv_q8_layout.GROUP

inline int64_t q8_groups(int64_t dim) { return dim % kQ8Group == 0 ? dim / kQ8Group : 1; }

// The bytes of one head's key or value in a q8 slot: its values, then its scales.
inline int64_t q8_width(int64_t dim) { return dim + 2 * q8_groups(dim); }

inline float bf16_value(uint16_t bits) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &wide, sizeof(value));
    return value;
}

// v rounded to bf16, half to even (torch's .to(torch.bfloat16) for finite values).
inline uint16_t bf16_bits(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// Elements 16 c .. 16 c + 15 of a q8 head (its values at `head`, its scales after them) as fp32.
inline __m512 load_chunk(const int8_t* head, int64_t c, int64_t dim) {
    const int64_t group = dim % kQ8Group == 0 ? 16 * c / kQ8Group : 0;
    uint16_t bits;
    std::memcpy(&bits, head + dim + 2 * group, sizeof(bits));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 16 * c));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)),
                         _mm512_set1_ps(bf16_value(bits)));
}

// One head's key or value x [dim] (dim a multiple of 16) written as q8 at `head`.
inline void store_q8_head(const float* x, int64_t dim, int8_t* head) {
    const int64_t groups = q8_groups(dim), size = dim / groups;
    const __m512i most = _mm512_set1_epi32(127), least = _mm512_set1_epi32(-127);
    for (int64_t g = 0; g < groups; ++g) {
        const float* in = x + g * size;
        const uint16_t bits = bf16_bits(largest_magnitude(in, size) / 127.0f);
        const float scale = bf16_value(bits);
        const __m512 divisor = _mm512_set1_ps(scale > 0.0f ? scale : 1.0f);
        for (int64_t i = 0; i < size; i += 16) {
            // Rounded half to even by the default rounding mode, as torch.round.
            const __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(in + i), divisor));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(head + g * size + i),
                             _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(q, least), most)));
        }
        std::memcpy(head + dim + 2 * g, &bits, sizeof(bits));
    }
}

// A token's keys and values kv [2 kv_heads, dim] written into its q8 slot.
inline void store_q8(const float* kv, int64_t kv_heads, int64_t dim, int8_t* slot) {
    for (int64_t h = 0; h < 2 * kv_heads; ++h) store_q8_head(kv + h * dim, dim, slot + h * q8_width(dim));
}

}  // namespace
