// The native CPU kernels, on AVX-512 VNNI (or on AVX2, built with MH_AVX2: native_avx2.h):
// linears over weights packed in their file's own quantization (native_qlinear.h, repacked by
// native_repack.h), a step's attention over the paged KV cache (fp32, fp16, or 8 bits:
// native_kv_q8.h) with the keys' norm, rotary and store, RMSNorm and gated activations, a whole decode step through the
// decoder layers (mh_decode_layers), and the sampler's choice of each row's token.
//
// Built and loaded by models/kernels/native.py (g++, ctypes). A weight byte is read from memory once
// for up to 8 rows, and the outputs are split among threads. Each row is computed with the same
// instructions in the same order whatever the other rows and the thread count are: outputs do
// not depend on the batch.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>
#include <type_traits>
#include <vector>

extern "C" int mh_cpu_supported() {
    __builtin_cpu_init();
#ifdef MH_AVX2
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
#endif
}

#pragma GCC push_options
#ifdef MH_AVX2  // the same kernels on pairs of 256-bit registers (native_avx2.h)
#pragma GCC target("avx2,fma,f16c")
#include "native_avx2.h"
using mh_avx2::dpbusd_nibble_pair;
#else
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")

namespace {

// acc + u . s + v . t in each int32 lane (4 byte products each), for unsigned bytes (weight
// levels) times signed ones: two VNNI instructions (AVX2 sums both in int16 first, which holds
// levels below 64: native_avx2.h's).
inline __m512i dpbusd_nibble_pair(__m512i acc, __m512i u, __m512i s, __m512i v, __m512i t) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, u, s), v, t);
}

}  // namespace
#endif

#include "native_common.h"  // the lanes' helpers every kernel shares
#include "native_qlinear.h"
#include "native_bf16.h"
#include "native_kv_q8.h"  // the 8-bit KV cache's slots

namespace {

thread_local std::vector<float> score_buffer;

// 16 cached keys' or values' elements as fp32: the pool holds fp32, or fp16 bits (uint16_t).
inline __m512 load_cached(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_cached(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Elements 16 c .. 16 c + 15 of a cached key or value head (q8 heads: native_kv_q8.h's).
template <typename T>
inline __m512 load_chunk(const T* head, int64_t c, int64_t) {
    return load_cached(head + 16 * c);
}

// Softmax attention of G query heads (queries [G, dim]) over one KV head's keys at positions
// `keys` (length of them, listed by `attend`); out [G, dim]. A value is `value_shift`
// elements after its key. Scores: each key converted once for the G heads, 16 keys' dot
// products summed together (sums_of_16). Values: passes of 16 accumulators (G heads times
// 16 / G chunks of 16 elements), each value chunk converted once for the G heads; the
// softmax's sum divided out at the end. The next keys and values are prefetched (a KV
// head's rows are a slot's width apart).
template <int G, typename T>
void attend_heads(const float* queries, int64_t dim, const T* const* keys, int64_t length,
                  int64_t value_shift, float scale, float softcap, float* out) {
    constexpr int64_t kKeysAhead = 16;
    constexpr int64_t kLine = 64 / sizeof(T);  // elements a cache line
    // A head's elements to prefetch: a q8 head's scales follow its values.
    const int64_t extent = std::is_same<T, int8_t>::value ? q8_width(dim) : dim;
    const int64_t chunks = dim / 16;           // head sizes are multiples of 16
    std::vector<float>& scores = score_buffer;  // [G, length rounded up to 16]
    const int64_t stride = (length + 15) / 16 * 16;
    if (static_cast<int64_t>(scores.size()) < G * stride) scores.resize(G * stride);
    for (int64_t i0 = 0; i0 < length; i0 += 16) {
        __m512 dots[G][16];
        for (int64_t k = 0; k < 16; ++k) {
            const int64_t i = i0 + k;
            if (i >= length) {
                for (int g = 0; g < G; ++g) dots[g][k] = _mm512_setzero_ps();
                continue;
            }
            if (i + kKeysAhead < length)
                for (int64_t e = 0; e < extent; e += kLine)
                    _mm_prefetch(keys[i + kKeysAhead] + e, _MM_HINT_T0);
            __m512 acc[G];
            for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; ++c) {
                const __m512 key = load_chunk(keys[i], c, dim);
                for (int g = 0; g < G; ++g)
                    acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(queries + g * dim + 16 * c), key,
                                             acc[g]);
            }
            for (int g = 0; g < G; ++g) dots[g][k] = acc[g];
        }
        for (int g = 0; g < G; ++g)
            _mm512_storeu_ps(scores.data() + g * stride + i0,
                             _mm512_mul_ps(sums_of_16(dots[g]), _mm512_set1_ps(scale)));
    }
    if (softcap > 0.0f)  // Gemma 2: scores squashed into (-softcap, softcap)
        for (int g = 0; g < G; ++g)
            for (int64_t i = 0; i < length; ++i) {
                float& score = scores[g * stride + i];
                score = softcap * std::tanh(score / softcap);
            }
    float inverse[G];  // per query head: 1 / the softmax's sum
    for (int g = 0; g < G; ++g) {
        float* s = scores.data() + g * stride;
        const __m512 shift = _mm512_set1_ps(max_of(s, length));
        __m512 total = _mm512_setzero_ps();
        for (int64_t i = 0; i < length; i += 16) {
            const __mmask16 live = tail_mask(length - i);
            const __m512 e = _mm512_maskz_mov_ps(
                live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + i), shift)));
            _mm512_mask_storeu_ps(s + i, live, e);
            total = _mm512_add_ps(total, e);
        }
        inverse[g] = 1.0f / _mm512_reduce_add_ps(total);
    }
    constexpr int64_t kChunks = 16 / G;  // value chunks a pass
    for (int64_t c0 = 0; c0 < chunks; c0 += kChunks) {
        const int64_t n = std::min(kChunks, chunks - c0);
        __m512 acc[G][kChunks];
        for (int g = 0; g < G; ++g)
            for (int64_t c = 0; c < kChunks; ++c) acc[g][c] = _mm512_setzero_ps();
        for (int64_t i = 0; i < length; ++i) {
            if (c0 == 0 && i + kKeysAhead < length)  // later passes find the values cached
                for (int64_t e = 0; e < extent; e += kLine)
                    _mm_prefetch(keys[i + kKeysAhead] + value_shift + e, _MM_HINT_T0);
            const T* value = keys[i] + value_shift;
            __m512 weight[G];
            for (int g = 0; g < G; ++g) weight[g] = _mm512_set1_ps(scores[g * stride + i]);
            for (int64_t c = 0; c < kChunks; ++c) {
                if (c >= n) break;
                const __m512 v = load_chunk(value, c0 + c, dim);
                for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(weight[g], v, acc[g][c]);
            }
        }
        for (int g = 0; g < G; ++g)
            for (int64_t c = 0; c < n; ++c)
                _mm512_storeu_ps(out + g * dim + 16 * (c0 + c),
                                 _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inverse[g])));
    }
}

// Softmax attention of `group` query heads (queries [group, dim]) over one KV head's keys at
// positions first .. first + length - 1 of a row's paged blocks (`table`); out [group, dim].
// A key is `key_offset` elements into its slot, its value `value_shift` elements after it.
// The keys' addresses are listed once (one division per block, not per key), then up to 8
// query heads at a time go through attend_heads.
template <typename T>
void attend(const float* queries, int64_t group, int64_t dim, const T* pool,
            int64_t slot_width, int64_t key_offset, int64_t value_shift, const int64_t* table,
            int64_t block_size, int64_t first, int64_t length, float scale, float softcap,
            float* out) {
    thread_local std::vector<const T*> keys;
    if (static_cast<int64_t>(keys.size()) < length) keys.resize(length);
    for (int64_t i = 0, p = first; i < length;) {
        const int64_t offset = p % block_size;
        const T* base = pool + (table[p / block_size] * block_size) * slot_width + key_offset;
        for (int64_t o = offset; o < block_size && i < length; ++o, ++i, ++p)
            keys[i] = base + o * slot_width;
    }
    for (int64_t g0 = 0; g0 < group; g0 += 8) {
        const float* q = queries + g0 * dim;
        float* o = out + g0 * dim;
        const T* const* k = keys.data();
        switch (std::min<int64_t>(8, group - g0)) {
            case 1: attend_heads<1>(q, dim, k, length, value_shift, scale, softcap, o); break;
            case 2: attend_heads<2>(q, dim, k, length, value_shift, scale, softcap, o); break;
            case 3: attend_heads<3>(q, dim, k, length, value_shift, scale, softcap, o); break;
            case 4: attend_heads<4>(q, dim, k, length, value_shift, scale, softcap, o); break;
            case 5: attend_heads<5>(q, dim, k, length, value_shift, scale, softcap, o); break;
            case 6: attend_heads<6>(q, dim, k, length, value_shift, scale, softcap, o); break;
            case 7: attend_heads<7>(q, dim, k, length, value_shift, scale, softcap, o); break;
            default: attend_heads<8>(q, dim, k, length, value_shift, scale, softcap, o); break;
        }
    }
}

// Rows of qkv [rows, (heads + 2 kv_heads) dim] made ready for attention, in place: each query
// and key head RMS-normed (qk_norm_weight [heads + kv_heads, dim], or null: none) and rotated
// (cos, sin [rows, dim]: rotate-half with the signed sin), then each row's keys and values
// copied into its pool slot as the pool's `kind` holds them: fp32, rounded to fp16 (the pool
// holds fp16 bits), or 8 bits with their scales (native_kv_q8.h). Prompt steps (hundreds of rows) split the rows among threads.
void store_keys(float* qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                const float* qk_norm_weight, float eps, const float* cos, const float* sin,
                void* pool, int kind, const int64_t* slots, int threads) {
    const int64_t width = (heads + 2 * kv_heads) * dim;
    const int64_t slot_width = 2 * kv_heads * dim;  // a key and a value for every KV head
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && rows >= kThreadedRows)
    for (int64_t r = 0; r < rows; ++r) {
        float* row = qkv + r * width;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
            if (qk_norm_weight != nullptr)
                rms_norm(row + h * dim, qk_norm_weight + h * dim, dim, eps, row + h * dim);
            rotate(row + h * dim, cos + r * dim, sin + r * dim, dim);
        }
        const float* kv = row + heads * dim;
        if (kind == kPoolQ8) {
            store_q8(kv, kv_heads, dim,
                     static_cast<int8_t*>(pool) + slots[r] * 2 * kv_heads * q8_width(dim));
        } else if (kind == kPoolF16) {
            uint16_t* slot = static_cast<uint16_t*>(pool) + slots[r] * slot_width;
            for (int64_t i = 0; i < slot_width; i += 16)  // dim is a multiple of 16
                _mm256_storeu_si256(
                    reinterpret_cast<__m256i*>(slot + i),
                    _mm512_cvtps_ph(_mm512_loadu_ps(kv + i), _MM_FROUND_TO_NEAREST_INT));
        } else {
            std::memcpy(static_cast<float*>(pool) + slots[r] * slot_width, kv,
                        slot_width * sizeof(float));
        }
    }
}

}  // namespace

// Attention for `rows` queries, each with its own position and table of blocks, over the paged
// KV pool (models/batch.py): a decode step's rows, or a prompt step's tokens (a table per
// token). q/k norms (optional), rotary, every new key and value written at its slot, then
// softmax attention of every query head over its visible keys (all positions <= its own,
// within `window` of it when window > 0), so a prompt's tokens see each other causally.
// qkv [rows, (H + 2 Hkv) D] is modified in place; out is [rows, H D]; the pool holds `kind`
// (PoolKind). Rows and KV heads are independent tasks.
extern "C" void mh_paged_attention(float* qkv, int64_t rows, int64_t heads, int64_t kv_heads,
                                   int64_t dim, const float* qk_norm_weight, float eps,
                                   const float* cos, const float* sin, void* pool, int kind,
                                   const int64_t* slots, const int64_t* blocks,
                                   int64_t blocks_per_row, int64_t block_size,
                                   const int64_t* positions, int64_t window, float scale,
                                   float softcap, float* out, int threads) {
    store_keys(qkv, rows, heads, kv_heads, dim, qk_norm_weight, eps, cos, sin, pool, kind, slots,
               threads);
    const int64_t width = (heads + 2 * kv_heads) * dim;
    const int64_t head = kind == kPoolQ8 ? q8_width(dim) : dim;  // a head's elements in a slot
    const int64_t slot_width = 2 * kv_heads * head;
    const int64_t group = heads / kv_heads;  // query heads sharing one KV head
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t task = 0; task < rows * kv_heads; ++task) {
        const int64_t r = task / kv_heads, h = task % kv_heads;
        const int64_t position = positions[r];
        const int64_t first = window > 0 && position >= window ? position - window + 1 : 0;
        const int64_t length = position - first + 1;
        const float* queries = qkv + r * width + h * group * dim;
        const int64_t* table = blocks + r * blocks_per_row;
        float* result = out + r * heads * dim + h * group * dim;
        if (kind == kPoolQ8)
            attend(queries, group, dim, static_cast<const int8_t*>(pool), slot_width, h * head,
                   kv_heads * head, table, block_size, first, length, scale, softcap, result);
        else if (kind == kPoolF16)
            attend(queries, group, dim, static_cast<const uint16_t*>(pool), slot_width, h * head,
                   kv_heads * head, table, block_size, first, length, scale, softcap, result);
        else
            attend(queries, group, dim, static_cast<const float*>(pool), slot_width, h * head,
                   kv_heads * head, table, block_size, first, length, scale, softcap, result);
    }
}

#include "native_prompt_attention.h"  // a prompt step's attention, tiled

namespace {

constexpr int64_t kDrawBlock = 256;  // logits a draw's block: its mass summed in one pass

thread_local std::vector<float> block_mass, block_top;

// An inverse-CDF draw from softmax(row / t) (inverse = 1 / t) with uniform u; see
// mh_choose_tokens. One pass over the row: each block of kDrawBlock logits is read into L1
// for its largest value, then summed as exponentials against it; the blocks' masses are
// rescaled to the row's largest afterwards, a vector pass over n / kDrawBlock values. Only
// the block the draw falls in is read again. Returns -1 when every logit is -inf.
int64_t draw(const float* row, int64_t n, float u, float inverse) {
    const int64_t blocks = (n + kDrawBlock - 1) / kDrawBlock;
    const int64_t padded = (blocks + 15) / 16 * 16;
    if (static_cast<int64_t>(block_mass.size()) < padded) {
        block_mass.resize(padded);
        block_top.resize(padded);
    }
    float* mass = block_mass.data();
    float* top = block_top.data();
    const __m512 none = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(inverse);
    // 16 exponentials against `shift` (none for -inf logits and lanes past the row).
    auto exponentials = [&](const float* x, int64_t count, __m512 shift) {
        const __m512 v = _mm512_mask_loadu_ps(none, tail_mask(count), x);
        const __mmask16 finite = _mm512_cmp_ps_mask(v, none, _CMP_NEQ_OQ);
        return _mm512_maskz_mov_ps(finite, exp16(_mm512_mul_ps(_mm512_sub_ps(v, shift), scale)));
    };
    float best = -INFINITY;
    for (int64_t b = 0; b < blocks; ++b) {
        const float* x = row + b * kDrawBlock;
        const int64_t count = std::min(kDrawBlock, n - b * kDrawBlock);
        top[b] = max_of(x, count);
        best = std::max(best, top[b]);
        __m512 sum = _mm512_setzero_ps();
        if (top[b] != -INFINITY) {
            const __m512 shift = _mm512_set1_ps(top[b]);
            for (int64_t i = 0; i < count; i += 16)
                sum = _mm512_add_ps(sum, exponentials(x + i, count - i, shift));
        }
        mass[b] = _mm512_reduce_add_ps(sum);
    }
    if (best == -INFINITY) return -1;
    for (int64_t b = blocks; b < padded; ++b) {  // the last vector's lanes past the row
        mass[b] = 0.0f;
        top[b] = -INFINITY;
    }
    const __m512 shift = _mm512_set1_ps(best);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < padded; b += 16) {  // each block's mass against the row's best
        const __m512 rescaled =
            _mm512_mul_ps(_mm512_loadu_ps(mass + b),
                          exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(top + b), shift),
                                              scale)));
        _mm512_storeu_ps(mass + b, rescaled);
        sum = _mm512_add_ps(sum, rescaled);
    }
    const float total = _mm512_reduce_add_ps(sum);
    const float target = std::min(u * total, std::nextafter(total, 0.0f));
    float running = 0.0f;
    int64_t b = 0;
    while (b < blocks - 1 && running + mass[b] <= target) running += mass[b++];
    // Within the block, the exponentials one by one against the row's best; summed in another
    // order they may round short of the target, and then the block's last token with mass is
    // chosen.
    const float* x = row + b * kDrawBlock;
    const int64_t count = std::min(kDrawBlock, n - b * kDrawBlock);
    int64_t at = -1;
    alignas(64) float e[16];
    for (int64_t i = 0; i < count; i += 16) {
        _mm512_store_ps(e, exponentials(x + i, count - i, shift));
        for (int64_t k = 0; k < 16 && i + k < count; ++k) {
            if (e[k] == 0.0f) continue;
            at = b * kDrawBlock + i + k;
            running += e[k];
            if (running > target) return at;
        }
    }
    return at < 0 ? b * kDrawBlock : at;
}

}  // namespace

// Token choices for rows of n logits, one per row: with uniforms null, the first index of each
// row's largest logit (torch.argmax); otherwise an inverse-CDF draw from softmax(row / t) with
// uniform u in [0, 1): the first index whose running probability mass exceeds u times the
// total (-inf logits, the filtered ones, have none). t is the row's temperature, or 1 where
// temperatures is null; applied here, it saves the caller a pass over the logits.
// Rows are independent tasks.
extern "C" void mh_choose_tokens(const float* logits, int64_t rows, int64_t n,
                                 const float* uniforms, const float* temperatures,
                                 int64_t* chosen, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = logits + r * n;
        int64_t at = -1;
        if (uniforms != nullptr)
            at = draw(row, n, uniforms[r], temperatures == nullptr ? 1.0f : 1.0f / temperatures[r]);
        if (at < 0) {  // greedy, or a row of -inf logits only: the first of its largest
            const float best = max_of(row, n);
            at = 0;
            while (at < n - 1 && !(row[at] == best)) ++at;
        }
        chosen[r] = at;
    }
}

// out[r] = rms_norm(x[r]) * weight for rows of `dim` (torch.rms_norm).
extern "C" void mh_rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim,
                            float eps, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && rows >= kThreadedRows)
    for (int64_t r = 0; r < rows; ++r) rms_norm(x + r * dim, weight, dim, eps, out + r * dim);
}

// out[r] = act(gate[r]) * up[r], where gate_up[r] = (gate, up), each of `width`:
// act 0 is SiLU, x / (1 + e^-x); act 1 is GELU's tanh form, x / (1 + e^(-2u)) with
// u = sqrt(2 / pi) (x + 0.044715 x^3) (the same function: 0.5 (1 + tanh u) = 1 / (1 + e^-2u)).
extern "C" void mh_gated_activation(const float* gate_up, int64_t rows, int64_t width, int act,
                                    float* out, int threads) {
    const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && rows >= kThreadedRows)
    for (int64_t r = 0; r < rows; ++r) {
        const float* gate = gate_up + r * 2 * width;
        const float* up = gate + width;
        for (int64_t i = 0; i < width; i += 16) {
            const __mmask16 live = tail_mask(width - i);
            const __m512 x = _mm512_maskz_loadu_ps(live, gate + i);
            __m512 exponent = x;  // SiLU: e^-x
            if (act == 1) {
                const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
                const __m512 u = _mm512_mul_ps(
                    _mm512_set1_ps(0.7978845608028654f),
                    _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, x));
                exponent = _mm512_add_ps(u, u);
            }
            const __m512 denominator = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(),
                                                                              exponent)));
            const __m512 activated = _mm512_div_ps(x, denominator);
            _mm512_mask_storeu_ps(out + r * width + i, live,
                                  _mm512_mul_ps(activated, _mm512_maskz_loadu_ps(live, up + i)));
        }
    }
}

#include "native_moe.h"  // a mixture of experts' MLP (mh_moe), which decode steps run too
#include "native_lora.h"  // rows' LoRA updates of a decode step's linears (add_lora)

// AMX tiles' intrinsics need GCC 11 or Clang 12; elsewhere (and in the AVX2 build) the bf16
// prompt attention stays on PyTorch's flash attention (mh_amx_ready answers 0).
#if !defined(MH_AVX2) && ((defined(__clang__) && __clang_major__ >= 12) || \
                          (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#include "native_amx_attention.h"  // a long prompt's bf16 attention on AMX tiles
#else
extern "C" int mh_amx_ready() { return 0; }
extern "C" void mh_amx_attention(const uint16_t*, int64_t, const void*, int, int64_t, int64_t,
                                 const int64_t*, int64_t, int64_t, int64_t, float, float*, float*,
                                 int) {}
#endif

// A whole decode step through the decoder layers, one call instead of ~15 a layer: for rows of
// one generated token each, hidden [rows, width] is updated in place. The structs mirror
// models/kernels/native.py's ctypes declarations.
struct NativeLinear {
    QLinear parts[3];    // one to three weights (q, k, v or gate, up), outputs side by side
    int64_t count;       // parts in use
    int64_t out;         // all parts' outputs together
    const float* bias;   // [out], or null
};

struct NativeLayer {
    NativeLinear qkv, o, gate_up, down;
    const float* input_norm;
    const float* attention_out_norm;  // or null (Gemma 3's post-attention norm)
    const float* mlp_in_norm;
    const float* mlp_out_norm;        // or null (Gemma 3's post-feedforward norm)
    const float* qk_norm;             // or null: [heads + kv_heads, dim]
    float eps, qk_eps, scale;
    float softcap;                    // attention scores' tanh cap, or 0: none
    float residual_scale;             // each branch's output times this before it is added
    int32_t act;                      // mh_gated_activation's
    int32_t rope;                     // which of the step's rotary tables: 0 global, 1 local, 2 none
    int64_t heads, kv_heads, dim, window;  // window > 0: sliding
    const NativeMoE* moe;             // or null: the MLP is a mixture of experts (no gate_up/down)
};

struct NativeStep {
    int64_t rows, width;
    const float* cos[3];                              // [rows, dim] each, NativeLayer.rope's
    const float* sin[3];
    void* const* pools;                               // one per layer
    int32_t pool_kind;                                // what the pools hold (PoolKind)
    const int64_t *slots, *blocks, *positions;
    int64_t blocks_per_row, block_size;
    int32_t threads;
    const NativeLora* lora;  // [layers][4]: qkv's, o's, gate_up's, down's updates; or null
};

namespace {

void linear(const NativeLinear& l, const float* x, int64_t rows, float* y, int threads) {
    // Parts of a quantized format share one rounding of the rows.
    bool quantized = false;
    for (int64_t i = 0; i < l.count; ++i) quantized |= !is_float_format(l.parts[i].format);
    const RoundedRows rounded =
        quantized ? round_rows(x, rows, l.parts[0].padded) : RoundedRows{};
    int64_t column = 0;
    for (int64_t i = 0; i < l.count; ++i) {
        const QLinear& part = l.parts[i];
        if (is_float_format(part.format))
            qlinear(x, rows, part, y + column, l.out, threads);
        else
            qlinear_rounded(rounded, rows, part, y + column, l.out, threads);
        column += part.out;
    }
    if (l.bias != nullptr)
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t i = 0; i < l.out; ++i) y[r * l.out + i] += l.bias[i];
}

// x += scale y
void add_into(float* x, const float* y, int64_t n, float scale) {
    const __m512 times = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, live, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, y + i), times,
                                                           _mm512_maskz_loadu_ps(live, x + i)));
    }
}

thread_local std::vector<float> layer_buffer;

}  // namespace

extern "C" void mh_decode_layers(float* hidden, const NativeLayer* layers, int64_t num_layers,
                                 const NativeStep* step) {
    const int64_t rows = step->rows, width = step->width;
    int64_t widest = width;
    for (int64_t i = 0; i < num_layers; ++i)
        widest = std::max({widest, layers[i].qkv.out, layers[i].gate_up.out, layers[i].o.parts[0].padded,
                           layers[i].down.parts[0].padded});
    widest = (widest + 15) / 16 * 16;  // every buffer starts on a cache line
    std::vector<float>& buffer = layer_buffer;
    if (static_cast<int64_t>(buffer.size()) < 3 * rows * widest + 16)
        buffer.resize(3 * rows * widest + 16);
    // 64-byte aligned: the kernels' 64-byte loads of activations that straddle two cache
    // lines cost about half the batched matmuls' speed.
    float* normed = buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / 4 % 16) % 16;
    float* wide = normed + rows * widest;
    float* narrow = wide + rows * widest;
    for (int64_t i = 0; i < num_layers; ++i) {
        const NativeLayer& l = layers[i];
        const NativeLora* lora = step->lora != nullptr ? step->lora + 4 * i : nullptr;
        mh_rms_norm(hidden, l.input_norm, rows, width, l.eps, normed, step->threads);
        linear(l.qkv, normed, rows, wide, step->threads);
        if (lora != nullptr) add_lora(lora[0], normed, rows, wide, l.qkv.out, step->threads);
        mh_paged_attention(wide, rows, l.heads, l.kv_heads, l.dim, l.qk_norm, l.qk_eps,
                           step->cos[l.rope], step->sin[l.rope], step->pools[i],
                           step->pool_kind, step->slots, step->blocks, step->blocks_per_row,
                           step->block_size, step->positions, l.window, l.scale, l.softcap,
                           narrow, step->threads);
        linear(l.o, narrow, rows, normed, step->threads);
        if (lora != nullptr) add_lora(lora[1], narrow, rows, normed, l.o.out, step->threads);
        if (l.attention_out_norm != nullptr)
            mh_rms_norm(normed, l.attention_out_norm, rows, width, l.eps, normed, step->threads);
        add_into(hidden, normed, rows * width, l.residual_scale);
        mh_rms_norm(hidden, l.mlp_in_norm, rows, width, l.eps, normed, step->threads);
        if (l.moe != nullptr) {
            mh_moe(normed, rows, width, l.moe, wide, step->threads);
            std::memcpy(normed, wide, sizeof(float) * rows * width);
        } else {
            linear(l.gate_up, normed, rows, wide, step->threads);
            if (lora != nullptr)
                add_lora(lora[2], normed, rows, wide, l.gate_up.out, step->threads);
            mh_gated_activation(wide, rows, l.gate_up.out / 2, l.act, narrow, step->threads);
            linear(l.down, narrow, rows, normed, step->threads);
            if (lora != nullptr) add_lora(lora[3], narrow, rows, normed, l.down.out, step->threads);
        }
        if (l.mlp_out_norm != nullptr)
            mh_rms_norm(normed, l.mlp_out_norm, rows, width, l.eps, normed, step->threads);
        add_into(hidden, normed, rows * width, l.residual_scale);
    }
}

#pragma GCC pop_options

// The size of each struct Python mirrors with ctypes (models/kernels/structs.py's STRUCTS, in
// this order), checked when the library loads: a layout changed on one side only is a clear
// error there, not a kernel reading memory at the wrong offsets. -1 past the last.
extern "C" int64_t mh_struct_size(int32_t which) {
    switch (which) {
        case 0: return sizeof(QLinear);
        case 1: return sizeof(NativeMoE);
        case 2: return sizeof(NativeLinear);
        case 3: return sizeof(NativeLayer);
        case 4: return sizeof(NativeStep);
        case 5: return sizeof(NativeLora);
        case 6: return sizeof(NativeLoraTarget);
        default: return -1;
    }
}
