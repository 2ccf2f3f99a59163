// A packed weight's rows dequantized to bf16, for PyTorch's bf16 GEMM: on a CPU with AMX
// (Intel Sapphire Rapids and later) oneDNN multiplies bf16 on its tiles several times faster
// than the integer kernels of native_qlinear.h can, so a long prompt's rows whose logits
// nobody reads take that path a slice of outputs at a time (models/kernels/packed.py). The
// values are the file's own, rounded once to bf16 (to nearest, ties to even).
// Included by native_kernels.cpp after native_qlinear.h.

#pragma once

#include "native_qlinear.h"

namespace {

inline uint16_t bf16_of(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// Output `row` of a weight of any format, as bf16 [padded], through its fp32 row.
void bf16_row(const QLinear& w, int64_t row, float* scratch, uint16_t* out) {
    switch (w.format) {
        case kQ4_0: dequantize_row<kQ4_0>(w, row, scratch); break;
        case kQ4_1: dequantize_row<kQ4_1>(w, row, scratch); break;
        case kQ5_0: dequantize_row<kQ5_0>(w, row, scratch); break;
        case kQ5_1: dequantize_row<kQ5_1>(w, row, scratch); break;
        case kQ8_0: dequantize_row<kQ8_0>(w, row, scratch); break;
        case kQ2_K: dequantize_row<kQ2_K>(w, row, scratch); break;
        case kQ3_K: dequantize_row<kQ3_K>(w, row, scratch); break;
        case kQ4_K: dequantize_row<kQ4_K>(w, row, scratch); break;
        case kQ5_K: dequantize_row<kQ5_K>(w, row, scratch); break;
        case kQ6_K: dequantize_row<kQ6_K>(w, row, scratch); break;
        case kF32: float_row<kF32>(w, row, scratch); break;
        case kF16: float_row<kF16>(w, row, scratch); break;
        case kBF16: float_row<kBF16>(w, row, scratch); break;
        default: std::memset(scratch, 0, 4 * w.padded); break;
    }
    for (int64_t i = 0; i < w.padded; ++i) out[i] = bf16_of(scratch[i]);
}

#ifndef MH_AVX2
// 16 floats rounded to bf16 (to nearest, ties to even), without AVX-512 BF16's instructions.
inline __m256i bf16_lanes(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// Block b's first `live` outputs (of 16) of a quantized weight, as bf16 rows of out [live, ld]:
// the block is unpacked as byte_panels unpacks it (levels and parameters, into `panel`), and
// output o's 32 levels of each group (dword o of each of its 8 registers) gathered, scaled and
// rounded.
template <int F>
void bf16_block(const QLinear& w, int64_t b, int64_t live, uint16_t* out, int64_t ld,
                std::vector<uint8_t>& panel) {
    constexpr int H = Format<F>::halves ? 2 : 1;
    const int64_t groups = w.padded / 32;
    const size_t level_bytes = 512 * groups, param_bytes = 128 * H * groups;
    if (panel.size() < level_bytes + param_bytes + 64) panel.resize(level_bytes + param_bytes + 64);
    uint8_t* levels = panel.data() + (64 - reinterpret_cast<uintptr_t>(panel.data()) % 64) % 64;
    float* params = reinterpret_cast<float*>(levels + level_bytes);
    unpack_panel<F>(w, b, groups, levels, params);
    const __m256i quads = _mm256_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448);
    for (int64_t g = 0; g < groups; ++g) {
        const float* first = params + 32 * H * g;  // scales [16], minimums [16] a half group
        const float* second = first + 32 * (H - 1);
        for (int64_t o = 0; o < live; ++o) {
            const __m256i bytes = _mm256_i32gather_epi32(
                reinterpret_cast<const int*>(levels + 512 * g + 4 * o), quads, 1);
            const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes)));
            const __m512 high =
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1)));
            uint16_t* row = out + o * ld + 32 * g;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row),
                                bf16_lanes(_mm512_fmadd_ps(low, _mm512_set1_ps(first[o]),
                                                           _mm512_set1_ps(first[16 + o]))));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16),
                                bf16_lanes(_mm512_fmadd_ps(high, _mm512_set1_ps(second[o]),
                                                           _mm512_set1_ps(second[16 + o]))));
        }
    }
}
#endif

// Block b's first `live` outputs as bf16 rows of out [live, ld]; scratch holds a fp32 row,
// panel a block's unpacked tiles.
void bf16_rows(const QLinear& w, int64_t b, int64_t live, float* scratch,
               std::vector<uint8_t>& panel, uint16_t* out, int64_t ld) {
#ifndef MH_AVX2  // AMX comes with AVX-512: the AVX2 build only ever answers tests
    switch (w.format) {
        case kQ4_0: return bf16_block<kQ4_0>(w, b, live, out, ld, panel);
        case kQ4_1: return bf16_block<kQ4_1>(w, b, live, out, ld, panel);
        case kQ5_0: return bf16_block<kQ5_0>(w, b, live, out, ld, panel);
        case kQ5_1: return bf16_block<kQ5_1>(w, b, live, out, ld, panel);
        case kQ8_0: return bf16_block<kQ8_0>(w, b, live, out, ld, panel);
        case kQ2_K: return bf16_block<kQ2_K>(w, b, live, out, ld, panel);
        case kQ3_K: return bf16_block<kQ3_K>(w, b, live, out, ld, panel);
        case kQ4_K: return bf16_block<kQ4_K>(w, b, live, out, ld, panel);
        case kQ5_K: return bf16_block<kQ5_K>(w, b, live, out, ld, panel);
        case kQ6_K: return bf16_block<kQ6_K>(w, b, live, out, ld, panel);
        default: break;  // float tiles: row by row below
    }
#else
    (void)panel;
#endif
    for (int64_t o = 0; o < live; ++o) bf16_row(w, 16 * b + o, scratch, out + o * ld);
}

}  // namespace

// out [count, ld] bf16 = the weight's outputs first .. first + count (first a multiple of 16),
// each over its padded inputs (zeros beyond the weight's own).
extern "C" void mh_dequantize_bf16(const QLinear* w, int64_t first, int64_t count, uint16_t* out,
                                   int64_t ld, int threads) {
    const int64_t blocks = (count + 15) / 16;
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        std::vector<float> scratch(w->padded);
        std::vector<uint8_t> panel;
#pragma omp for schedule(static)
        for (int64_t k = 0; k < blocks; ++k) {
            const int64_t live = std::min<int64_t>(16, count - 16 * k);
            bf16_rows(*w, first / 16 + k, live, scratch.data(), panel, out + 16 * k * ld, ld);
        }
    }
}
