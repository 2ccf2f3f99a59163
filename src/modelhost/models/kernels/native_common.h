// What every kernel shares, declared once: the standard headers, the helpers on 16 lanes (tail
// masks, sums, exp, dot products, RMSNorm, rotary), the rows rounded to bytes for the integer
// dot products, and the entry points one header calls in another (native_moe.h runs
// mh_gated_activation). Included inside native_kernels.cpp's target region (AVX-512 VNNI, or
// AVX2 through native_avx2.h), before the headers that use it.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;  // inputs of a packed tile (native_qlinear.h)
constexpr int kTile = 8;        // rows computed together per weight read
// Weights are prefetched kAhead tiles ahead (~2-4 KB): the hardware's prefetchers alone left the
// kernels well short of memory's bandwidth. A prefetch past the weights' end never faults.
constexpr int64_t kAhead = 8;
// Row-wise kernels (key storing, RMSNorm, gated activations) split a prompt step's rows (hundreds)
// among threads; a decode step's few rows stay on the calling thread.
constexpr int64_t kThreadedRows = 64;

// The first count lanes (none for count <= 0, all 16 for count >= 16).
inline __mmask16 tail_mask(int64_t count) {
    if (count <= 0) return 0;
    return count >= 16 ? static_cast<__mmask16>(0xFFFF)
                       : static_cast<__mmask16>((1u << count) - 1u);
}

// The largest of x[0 .. n) (-inf for none).
inline float max_of(const float* x, int64_t n) {
    const __m512 none = _mm512_set1_ps(-INFINITY);
    __m512 top = none;
    for (int64_t i = 0; i < n; i += 16)
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(none, tail_mask(n - i), x + i));
    return _mm512_reduce_max_ps(top);
}

// The largest |x[i]| of x[0 .. n) (0 for none).
inline float largest_magnitude(const float* x, int64_t n) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    __m512 top = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
        top = _mm512_max_ps(top, _mm512_and_ps(_mm512_maskz_loadu_ps(tail_mask(n - i), x + i),
                                               magnitude));
    return _mm512_reduce_max_ps(top);
}

// Lane k: the sum of v[k]'s 16 lanes. 45 shuffles and adds for 16 sums, where a horizontal
// sum each costs 8.
inline __m512 sums_of_16(const __m512* v) {
    __m512 pairs[8], quads[4], halves[2];
    for (int j = 0; j < 8; ++j)  // per 128 bits: v[2j] 0+2, v[2j+1] 0+2, v[2j] 1+3, v[2j+1] 1+3
        pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                                 _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; ++j)  // per 128 bits: v[4j .. 4j + 3]'s partial sums
        quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0xEE));
    for (int j = 0; j < 2; ++j)
        halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// Activations for the quantized kernels (native_qlinear.h), rounded so that integer dot
// products take them exactly in int32: each row has one scale (its largest magnitude / 127)
// and each input is v = (high + low / 256) * scale with int8 high and low, 16 bits against the
// row's largest. One int8 alone (llama.cpp's Q8 activations, a scale per 32) cost the embedded
// models perplexity and greedy agreement with fp32; these keep both (benchmarks/perplexity.py).
// A product of 4 weights and 4 inputs is high's VNNI product times 256 plus low's.
// Per row: high and low in the inputs' order; its scale (/ 256); and each 16 rounded inputs'
// sum (high * 256 + low), which the weights' group minimums multiply.
struct RoundedRows {
    int64_t groups, padded;
    const int8_t* high;    // [rows, padded]
    const int8_t* low;     // [rows, padded]
    const float* scales;   // [rows]
    const float* sums;     // [rows, padded / 16]
};

thread_local std::vector<uint8_t> rounded_buffer;

RoundedRows round_rows(const float* x, int64_t rows, int64_t padded) {
    const int64_t sixteens = padded / 16;
    const size_t per_row = 2 * padded + 4 * sixteens + 4;
    std::vector<uint8_t>& buffer = rounded_buffer;
    if (buffer.size() < rows * per_row + 64) buffer.resize(rows * per_row + 64);
    uint8_t* base = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
    int8_t* high = reinterpret_cast<int8_t*>(base);
    int8_t* low = high + rows * padded;
    float* sums = reinterpret_cast<float*>(low + rows * padded);
    float* scales = sums + rows * sixteens;
    const __m512i most = _mm512_set1_epi32(127), least = _mm512_set1_epi32(-127);
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = x + r * padded;
        const float amax = largest_magnitude(row, padded);
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        scales[r] = amax / (127.0f * 256.0f);
        for (int64_t i = 0; i < padded; i += 16) {
            const __m512 v = _mm512_loadu_ps(row + i);
            const __m512 scaled = _mm512_mul_ps(v, _mm512_set1_ps(inverse));
            const __m512i h = _mm512_cvtps_epi32(scaled);
            const __m512i l = _mm512_min_epi32(
                _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(
                                     _mm512_sub_ps(scaled, _mm512_cvtepi32_ps(h)),
                                     _mm512_set1_ps(256.0f))),
                                 least),
                most);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(high + r * padded + i),
                             _mm512_cvtepi32_epi8(h));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(low + r * padded + i),
                             _mm512_cvtepi32_epi8(l));
            // The rounded inputs' sum (in units of the row's scale): the weights' minimums
            // multiply it, so a minimum that only offsets the levels (Q8_0's -128 x scale)
            // cancels exactly instead of multiplying the rounding error.
            sums[r * sixteens + i / 16] = static_cast<float>(
                _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(h, 8), l)));
        }
    }
    return RoundedRows{padded / kGroup, padded, high, low, scales, sums};
}

// Activations rounded to 8 bits, for prompt rows whose logits nobody reads (models/kernels/
// packed.py's coarse rows): each 32 inputs of a row as int8 with one scale (their largest
// magnitude / 127), as llama.cpp's Q8_0, so a product of 4 weights and 4 inputs is one VNNI
// instruction where RoundedRows takes two. Per row: the int8 inputs; each group's scale; and
// each 16 rounded inputs' sum times their group's scale, which the weights' minimums multiply.
// The integer sums alone (per 16 inputs, and per group of 32) serve the panel kernel
// (native_qlinear.h's byte_panels), which applies the row's group scale once per group.
struct ByteRows {
    int64_t groups, padded;
    const int8_t* q;       // [rows, padded]
    const float* scales;   // [rows, groups]
    const float* sums;     // [rows, padded / 16]
    const float* counts;   // [rows, padded / 16]: the rounded inputs' integer sums
    const float* totals;   // [rows, groups]: the same per group of 32
};

thread_local std::vector<uint8_t> byte_buffer;

ByteRows byte_rows(const float* x, int64_t rows, int64_t padded) {
    const int64_t groups = padded / kGroup, sixteens = padded / 16;
    const size_t per_row = padded + 8 * groups + 8 * sixteens;
    std::vector<uint8_t>& buffer = byte_buffer;
    if (buffer.size() < rows * per_row + 64) buffer.resize(rows * per_row + 64);
    uint8_t* base = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
    int8_t* q = reinterpret_cast<int8_t*>(base);
    float* scales = reinterpret_cast<float*>(q + rows * padded);
    float* sums = scales + rows * groups;
    float* counts = sums + rows * sixteens;
    float* totals = counts + rows * sixteens;
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    // One thread: a parallel region of its own cost more on a loaded machine (a thread
    // preempted at its barrier) than the rounding, ~2% of the matmul's work, saves.
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
            const float* in = x + r * padded + kGroup * g;
            const __m512 a = _mm512_loadu_ps(in), b = _mm512_loadu_ps(in + 16);
            const float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_and_ps(a, magnitude), _mm512_and_ps(b, magnitude)));
            const float scale = amax / 127.0f;
            const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            scales[r * groups + g] = scale;
            for (int half = 0; half < 2; ++half) {
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(half ? b : a, inverse));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * padded + kGroup * g + 16 * half),
                                 _mm512_cvtepi32_epi8(v));
                const float count = static_cast<float>(_mm512_reduce_add_epi32(v));
                sums[r * sixteens + 2 * g + half] = count * scale;
                counts[r * sixteens + 2 * g + half] = count;
            }
            totals[r * groups + g] = counts[r * sixteens + 2 * g] + counts[r * sixteens + 2 * g + 1];
        }
    }
    return ByteRows{groups, padded, q, scales, sums, counts, totals};
}

// Calls tile(row0, rows-in-tile, first output, end output) over all rows and outputs, the
// outputs split among `threads` (weights stream from memory: one core alone cannot saturate
// it). Which thread computes an output never changes its value.
template <typename Tile>
void by_tiles(int64_t rows, int64_t out, int threads, Tile tile) {
    // Eight chunks a thread, handed out as threads come free: on a shared machine a thread
    // that is preempted mid-call leaves its chunks to the others instead of stalling the call.
    const int64_t share = (out + 8 * threads - 1) / (8 * threads);
    const int64_t chunk = std::max<int64_t>(16, (share + 15) / 16 * 16);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t begin = 0; begin < out; begin += chunk) {
        const int64_t end = begin + chunk < out ? begin + chunk : out;
        int64_t r = 0;
        for (; r + kTile <= rows; r += kTile)
            tile(r, std::integral_constant<int, kTile>(), begin, end);
        switch (rows - r) {
            case 7: tile(r, std::integral_constant<int, 7>(), begin, end); break;
            case 6: tile(r, std::integral_constant<int, 6>(), begin, end); break;
            case 5: tile(r, std::integral_constant<int, 5>(), begin, end); break;
            case 4: tile(r, std::integral_constant<int, 4>(), begin, end); break;
            case 3: tile(r, std::integral_constant<int, 3>(), begin, end); break;
            case 2: tile(r, std::integral_constant<int, 2>(), begin, end); break;
            case 1: tile(r, std::integral_constant<int, 1>(), begin, end); break;
            default: break;
        }
    }
}

}  // namespace

namespace {

// exp on 16 lanes: 2^(x log2 e) as 2^n * 2^f, |f| <= 1/2, 2^f by its Taylor series to
// degree 7 (relative error below 1e-8), 2^n applied with vscalefps (no overflow games).
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

inline float dot(const float* a, const float* b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = tail_mask(n - i);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, a + i), _mm512_maskz_loadu_ps(live, b + i),
                              acc);
    }
    return _mm512_reduce_add_ps(acc);
}

// out = x * rsqrt(mean(x^2) + eps) * weight (torch.rms_norm); out may be x.
inline void rms_norm(const float* x, const float* weight, int64_t n, float eps, float* out) {
    const __m512 factor = _mm512_set1_ps(1.0f / std::sqrt(dot(x, x, n) / n + eps));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = tail_mask(n - i);
        const __m512 normed = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, x + i), factor);
        _mm512_mask_storeu_ps(out + i, live,
                              _mm512_mul_ps(normed, _mm512_maskz_loadu_ps(live, weight + i)));
    }
}

// NEOX rotary in place: x * cos + (x2, x1) * (-sin, sin) (cos and the signed sin: [dim]).
inline void rotate(float* x, const float* cos, const float* sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 live = tail_mask(half - i);
        __m512 a = _mm512_maskz_loadu_ps(live, x + i);
        __m512 b = _mm512_maskz_loadu_ps(live, x + half + i);
        __m512 ra = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(live, cos + i),
                                    _mm512_mul_ps(b, _mm512_maskz_loadu_ps(live, sin + i)));
        __m512 rb = _mm512_fmadd_ps(b, _mm512_maskz_loadu_ps(live, cos + half + i),
                                    _mm512_mul_ps(a, _mm512_maskz_loadu_ps(live, sin + half + i)));
        _mm512_mask_storeu_ps(x + i, live, ra);
        _mm512_mask_storeu_ps(x + half + i, live, rb);
    }
}

}  // namespace

// Defined in native_kernels.cpp.
extern "C" void mh_gated_activation(const float* gate_up, int64_t rows, int64_t width, int act,
                                    float* out, int threads);
