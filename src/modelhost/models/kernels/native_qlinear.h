// Linear weights in the quantization of the file they came from, and the matmul that reads
// them: every GGUF type people download (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K) and
// 16-bit floats (F16, BF16), each repacked losslessly (native_repack.h) into tiles of 16
// outputs by 32 inputs, so one kernel body serves them all: a tile's levels are unpacked to
// unsigned bytes in 8 registers (byte 4o + k of register q: output o's input 4q + k), each
// row's rounded activations (round_rows) are broadcast against them 4 inputs at a time, and a
// group's (or half group's) integer products take that group's 16 scales and 16 minimums.
// Included by native_kernels.cpp inside its target region (AVX-512 VNNI, or AVX2 through
// native_avx2.h).
//
// Storage, per block b of 16 outputs (the last padded with zeros) and group g of 32 inputs
// (inputs padded with zeros to a multiple of 64), three arrays:
//   data    [blocks, groups, tile bytes]: the levels' bit planes, in this order:
//             nibbles (256 B): in run j of 64 bytes, byte 4o + k holds the low 4 bits of
//                 output o's input 8j + k (low nibble) and 8j + 4 + k (high nibble);
//             crumbs (128 B): 2 bits a level; in load c, byte 4o + k bits 2i, 2i + 1 belong
//                 to register q = 4c + i (its byte 4o + k);
//             bits (64 B): byte 4o + k bit q belongs to register q;
//             bytes (512 B): register q is bytes 64q .. 64q + 63.
//           4 bits: nibbles. 5: nibbles + bits (bit 4). 6: nibbles + crumbs (bits 4-5).
//           8: bytes. 2: crumbs. 3: crumbs + bits (bit 2). F32/F16/BF16 tiles: 32 inputs
//           by 16 outputs of the file's floats (input-major, 2 or 1 KB).
//   params  per tile: legacy types fp16 scales [16] (and fp16 minimums [16] for Q4_1, Q5_1);
//           K types int8 sub-scales [16] (and int8 sub-minimums [16] where the type has
//           them), for each sub-block of the group (two for 16-input sub-blocks);
//   supers  K types, per block and 256 inputs: fp16 d [16], fp16 dmin [16] (the minimum's
//           factor, its sign folded in; symmetric types: dmin = -32 d (Q6_K), -4 d (Q3_K)).
// A weight is level * scale + min, with scale = d * sc and min = dmin * m (or dmin * sc for
// the symmetric K types, or min = c * scale for Q4_0, Q5_0, Q8_0: c = -8, -16, -128): the
// dequantized value of the file, exactly (fp16 d and dmin times small integers are exact in
// fp32).

#pragma once

#include "native_common.h"

struct QLinear {          // mirrors models/kernels/native.py's QLinearDesc
    int32_t format;       // the GGUF type id (kQ4_0 ...)
    int32_t reserved;
    const uint8_t* data;
    const uint8_t* params;
    const uint16_t* supers;
    int64_t out, padded;  // outputs; inputs padded to a multiple of 64
};

namespace {

// GGUF's type ids, which name the formats here too.
constexpr int32_t kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10,
                  kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30;

enum ParamKind { kDirect, kDirectSymmetric, kSuper };

template <int F>
struct Format;
// bits: a level's; params: how scales and minimums are stored; halves: 16-input sub-blocks;
// sym: K types whose minimum is dmin * sc; min_factor: c for the symmetric legacy types.
#define MH_FORMAT(F, BITS, PARAMS, HALVES, SYM, MIN_FACTOR)          \
    template <>                                                      \
    struct Format<F> {                                               \
        static constexpr int bits = BITS;                            \
        static constexpr ParamKind params = PARAMS;                  \
        static constexpr bool halves = HALVES, sym = SYM;            \
        static constexpr float min_factor = MIN_FACTOR;              \
    };
MH_FORMAT(kQ4_0, 4, kDirectSymmetric, false, false, -8.0f)
MH_FORMAT(kQ4_1, 4, kDirect, false, false, 0.0f)
MH_FORMAT(kQ5_0, 5, kDirectSymmetric, false, false, -16.0f)
MH_FORMAT(kQ5_1, 5, kDirect, false, false, 0.0f)
MH_FORMAT(kQ8_0, 8, kDirectSymmetric, false, false, -128.0f)
MH_FORMAT(kQ2_K, 2, kSuper, true, false, 0.0f)
MH_FORMAT(kQ3_K, 3, kSuper, true, true, 0.0f)
MH_FORMAT(kQ4_K, 4, kSuper, false, false, 0.0f)
MH_FORMAT(kQ5_K, 5, kSuper, false, false, 0.0f)
MH_FORMAT(kQ6_K, 6, kSuper, true, true, 0.0f)
#undef MH_FORMAT

constexpr int64_t tile_bytes(int bits) {
    return bits == 2 ? 128 : bits == 3 ? 192 : bits == 4 ? 256 : bits == 5 ? 320
         : bits == 6 ? 384 : 512;
}

template <int F>
constexpr int64_t param_bytes() {
    using T = Format<F>;
    if (T::params == kDirect) return 64;
    if (T::params == kDirectSymmetric) return 32;
    return 16 * (T::halves ? 2 : 1) * (T::sym ? 1 : 2);
}

// Bytes of a float tile: 32 inputs x 16 outputs.
constexpr int64_t float_tile_bytes(int32_t format) { return format == kF32 ? 2048 : 1024; }

#ifdef MH_AVX2
// AVX2 sums two byte products in int16 (dpbusd_nibble_pair), exact for levels below 64; 8-bit
// levels are split into two nibbles, each multiplied alone.
template <int bits>
constexpr int kRegisters = bits == 8 ? 16 : 8;
#else
template <int bits>
constexpr int kRegisters = 8;
#endif

// (v >> s) for s > 0, (v << -s) for s < 0, per 16-bit lane; then masked to `mask` per byte.
template <int S>
inline __m512i shifted(__m512i v, __m512i mask) {
    if constexpr (S > 0) return _mm512_and_si512(_mm512_srli_epi16(v, S), mask);
    else if constexpr (S < 0) return _mm512_and_si512(_mm512_slli_epi16(v, -S), mask);
    else return _mm512_and_si512(v, mask);
}

// The 8 registers of a tile's levels (see the storage above), from its planes at `t`.
template <int bits>
inline void unpack(const uint8_t* t, __m512i* w) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    if constexpr (bits == 8) {
        for (int q = 0; q < 8; ++q) {
            const __m512i v = _mm512_load_si512(t + 64 * q);
#ifdef MH_AVX2
            w[q] = _mm512_and_si512(v, low4);
            w[8 + q] = shifted<4>(v, low4);
#else
            w[q] = v;
#endif
        }
        return;
    }
    if constexpr (bits >= 4) {
        for (int j = 0; j < 4; ++j) {
            const __m512i v = _mm512_load_si512(t + 64 * j);
            w[2 * j] = _mm512_and_si512(v, low4);
            w[2 * j + 1] = shifted<4>(v, low4);
        }
    }
    if constexpr (bits == 5) {
        const __m512i b = _mm512_load_si512(t + 256), bit4 = _mm512_set1_epi8(0x10);
        w[0] = _mm512_or_si512(w[0], shifted<-4>(b, bit4));
        w[1] = _mm512_or_si512(w[1], shifted<-3>(b, bit4));
        w[2] = _mm512_or_si512(w[2], shifted<-2>(b, bit4));
        w[3] = _mm512_or_si512(w[3], shifted<-1>(b, bit4));
        w[4] = _mm512_or_si512(w[4], shifted<0>(b, bit4));
        w[5] = _mm512_or_si512(w[5], shifted<1>(b, bit4));
        w[6] = _mm512_or_si512(w[6], shifted<2>(b, bit4));
        w[7] = _mm512_or_si512(w[7], shifted<3>(b, bit4));
    }
    if constexpr (bits == 6) {
        const __m512i high2 = _mm512_set1_epi8(0x30);
        for (int c = 0; c < 2; ++c) {
            const __m512i v = _mm512_load_si512(t + 256 + 64 * c);
            w[4 * c] = _mm512_or_si512(w[4 * c], shifted<-4>(v, high2));
            w[4 * c + 1] = _mm512_or_si512(w[4 * c + 1], shifted<-2>(v, high2));
            w[4 * c + 2] = _mm512_or_si512(w[4 * c + 2], shifted<0>(v, high2));
            w[4 * c + 3] = _mm512_or_si512(w[4 * c + 3], shifted<2>(v, high2));
        }
    }
    if constexpr (bits <= 3) {
        const __m512i low2 = _mm512_set1_epi8(0x03);
        for (int c = 0; c < 2; ++c) {
            const __m512i v = _mm512_load_si512(t + 64 * c);
            w[4 * c] = shifted<0>(v, low2);
            w[4 * c + 1] = shifted<2>(v, low2);
            w[4 * c + 2] = shifted<4>(v, low2);
            w[4 * c + 3] = shifted<6>(v, low2);
        }
    }
    if constexpr (bits == 3) {
        const __m512i b = _mm512_load_si512(t + 128), bit2 = _mm512_set1_epi8(0x04);
        w[0] = _mm512_or_si512(w[0], shifted<-2>(b, bit2));
        w[1] = _mm512_or_si512(w[1], shifted<-1>(b, bit2));
        w[2] = _mm512_or_si512(w[2], shifted<0>(b, bit2));
        for (int q = 3; q < 8; ++q) {
            // shifted<q - 2>, spelled out for the template argument
            const __m512i s = q == 3 ? shifted<1>(b, bit2) : q == 4 ? shifted<2>(b, bit2)
                            : q == 5 ? shifted<3>(b, bit2) : q == 6 ? shifted<4>(b, bit2)
                                                                    : shifted<5>(b, bit2);
            w[q] = _mm512_or_si512(w[q], s);
        }
    }
}

// A row's products with quads 4h .. 4h + 3 of the unpacked tile, each lane an output: x holds
// the row's 8 quads of int8 inputs of the group (as int32).
template <int bits>
inline __m512i half_dot(const __m512i* w, const int32_t* x, int h) {
    const int q = 4 * h;
    __m512i acc = dpbusd_nibble_pair(_mm512_setzero_si512(), w[q], _mm512_set1_epi32(x[q]),
                                     w[q + 1], _mm512_set1_epi32(x[q + 1]));
    acc = dpbusd_nibble_pair(acc, w[q + 2], _mm512_set1_epi32(x[q + 2]), w[q + 3],
                             _mm512_set1_epi32(x[q + 3]));
#ifdef MH_AVX2
    if constexpr (bits == 8) {
        __m512i high = dpbusd_nibble_pair(_mm512_setzero_si512(), w[8 + q],
                                          _mm512_set1_epi32(x[q]), w[9 + q],
                                          _mm512_set1_epi32(x[q + 1]));
        high = dpbusd_nibble_pair(high, w[10 + q], _mm512_set1_epi32(x[q + 2]), w[11 + q],
                                  _mm512_set1_epi32(x[q + 3]));
        acc = _mm512_add_epi32(acc, _mm512_slli_epi32(high, 4));
    }
#endif
    return acc;
}

// half_dot over inputs already broadcast (xb[q]: quad q of a row's 8-bit inputs in every
// lane), for 8-bit activations (ByteRows): each block of a pair reuses the broadcasts.
template <int bits>
inline __m512i quads_dot(const __m512i* w, const __m512i* xb, int h) {
    const int q = 4 * h;
    __m512i acc = dpbusd_nibble_pair(_mm512_setzero_si512(), w[q], xb[q], w[q + 1], xb[q + 1]);
    acc = dpbusd_nibble_pair(acc, w[q + 2], xb[q + 2], w[q + 3], xb[q + 3]);
#ifdef MH_AVX2
    if constexpr (bits == 8) {
        __m512i high = dpbusd_nibble_pair(_mm512_setzero_si512(), w[8 + q], xb[q], w[9 + q],
                                          xb[q + 1]);
        high = dpbusd_nibble_pair(high, w[10 + q], xb[q + 2], w[11 + q], xb[q + 3]);
        acc = _mm512_add_epi32(acc, _mm512_slli_epi32(high, 4));
    }
#endif
    return acc;
}

inline __m512 int8_to_ps(const uint8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 fp16_to_ps(const void* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

// A tile's scales and minimums per half group (both halves the same where the type's
// sub-blocks are 32 inputs): d and dmin are the block's super-block factors (K types).
template <int F>
inline void tile_params(const uint8_t* p, __m512 d, __m512 dmin, __m512* scale, __m512* min) {
    using T = Format<F>;
    if constexpr (T::params == kDirect) {
        scale[0] = scale[1] = fp16_to_ps(p);
        min[0] = min[1] = fp16_to_ps(p + 32);
    } else if constexpr (T::params == kDirectSymmetric) {
        scale[0] = scale[1] = fp16_to_ps(p);
        min[0] = min[1] = _mm512_mul_ps(scale[0], _mm512_set1_ps(T::min_factor));
    } else {
        constexpr int stride = T::sym ? 16 : 32;  // bytes a sub-block
        for (int h = 0; h < (T::halves ? 2 : 1); ++h) {
            const __m512 sc = int8_to_ps(p + stride * h);
            scale[h] = _mm512_mul_ps(d, sc);
            min[h] = _mm512_mul_ps(dmin, T::sym ? sc : int8_to_ps(p + stride * h + 16));
        }
        if constexpr (!T::halves) {
            scale[1] = scale[0];
            min[1] = min[0];
        }
    }
}

// R rows times NB consecutive blocks of outputs' quantized weights (see the storage above),
// outputs in the lanes, from block b on. y is [rows, ldy]; outputs go to their own columns.
// With NB = 2 each of a row's broadcast inputs feeds both blocks' levels (16 registers): half
// the broadcasts and row bookkeeping per product, for the same sums in the same order (a
// block's outputs do not depend on NB, nor on R).
//
// Rows is RoundedRows (16-bit activations under one scale a row) or ByteRows (8-bit ones under
// one scale each 32 inputs: one VNNI product a multiply-add instead of two, a group's integer
// sums scaled by the row's group scale before they join the row's float sums).
template <int R, int F, int NB, typename Rows>
void q_blocks(const Rows& x, int64_t row0, const QLinear& w, int64_t b, float* y,
              int64_t ldy) {
    constexpr bool bytes = std::is_same_v<Rows, ByteRows>;
    using T = Format<F>;
    constexpr int64_t tile = tile_bytes(T::bits), pbytes = param_bytes<F>();
    const int64_t groups = x.groups, sixteens = x.padded / 16;
    __m512 acc[NB][R];
    for (int n = 0; n < NB; ++n)
        for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
    __m512 d[NB], dmin[NB];
    for (int n = 0; n < NB; ++n) d[n] = dmin[n] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i levels[NB][kRegisters<T::bits>];
        __m512 scale[NB][2], min[NB][2];
        for (int n = 0; n < NB; ++n) {
            const int64_t at = (b + n) * groups + g;
            const uint8_t* t = w.data + at * tile;
            for (int64_t line = 0; line < tile; line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(t + kAhead * tile + line),
                             _MM_HINT_T0);
            const uint8_t* p = w.params + at * pbytes;
            _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * pbytes), _MM_HINT_T0);
            unpack<T::bits>(t, levels[n]);
            if constexpr (T::params == kSuper) {
                if (g % 8 == 0) {
                    const uint16_t* s = w.supers + ((b + n) * (groups / 8) + g / 8) * 32;
                    d[n] = fp16_to_ps(s);
                    dmin[n] = fp16_to_ps(s + 16);
                }
            }
            tile_params<F>(p, d[n], dmin[n], scale[n], min[n]);
        }
        for (int r = 0; r < R; ++r) {
            const int64_t row = row0 + r;
            if constexpr (bytes) {
                const int32_t* q = reinterpret_cast<const int32_t*>(x.q + row * x.padded + 32 * g);
                const __m512 scaled = _mm512_set1_ps(x.scales[row * groups + g]);
                const float* sums = x.sums + row * sixteens + 2 * g;
                __m512i dots[NB][2];
                if constexpr (NB == 1) {
                    __m512i xb[8];
                    for (int k = 0; k < 8; ++k) xb[k] = _mm512_set1_epi32(q[k]);
                    dots[0][0] = quads_dot<T::bits>(levels[0], xb, 0);
                    dots[0][1] = quads_dot<T::bits>(levels[0], xb, 1);
                } else {  // each broadcast feeds both blocks as soon as it is made
                    for (int n = 0; n < NB; ++n) dots[n][0] = dots[n][1] = _mm512_setzero_si512();
                    for (int k = 0; k < 8; k += 2) {
                        const __m512i x0 = _mm512_set1_epi32(q[k]), x1 = _mm512_set1_epi32(q[k + 1]);
                        for (int n = 0; n < NB; ++n)
                            dots[n][k / 4] = dpbusd_nibble_pair(dots[n][k / 4], levels[n][k], x0,
                                                                levels[n][k + 1], x1);
                    }
                }
                for (int n = 0; n < NB; ++n) {
                    const __m512i d0 = dots[n][0], d1 = dots[n][1];
                    if constexpr (T::halves) {
                        acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0),
                                                    _mm512_mul_ps(scale[n][0], scaled), acc[n][r]);
                        acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1),
                                                    _mm512_mul_ps(scale[n][1], scaled), acc[n][r]);
                        acc[n][r] = _mm512_fmadd_ps(min[n][0], _mm512_set1_ps(sums[0]), acc[n][r]);
                        acc[n][r] = _mm512_fmadd_ps(min[n][1], _mm512_set1_ps(sums[1]), acc[n][r]);
                    } else {
                        acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)),
                                                    _mm512_mul_ps(scale[n][0], scaled), acc[n][r]);
                        acc[n][r] = _mm512_fmadd_ps(min[n][0], _mm512_set1_ps(sums[0] + sums[1]),
                                                    acc[n][r]);
                    }
                }
                continue;
            } else {
            const int32_t* high =
                reinterpret_cast<const int32_t*>(x.high + row * x.padded + 32 * g);
            const int32_t* low = reinterpret_cast<const int32_t*>(x.low + row * x.padded + 32 * g);
            const float* sums = x.sums + row * sixteens + 2 * g;
            if constexpr (NB == 1) {
                const __m512i* lv = levels[0];
                const __m512i h0 = half_dot<T::bits>(lv, high, 0);
                const __m512i h1 = half_dot<T::bits>(lv, high, 1);
                const __m512i l0 = half_dot<T::bits>(lv, low, 0);
                const __m512i l1 = half_dot<T::bits>(lv, low, 1);
                if constexpr (T::halves) {
                    const __m512i d0 = _mm512_add_epi32(_mm512_slli_epi32(h0, 8), l0);
                    const __m512i d1 = _mm512_add_epi32(_mm512_slli_epi32(h1, 8), l1);
                    acc[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), scale[0][0], acc[0][r]);
                    acc[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), scale[0][1], acc[0][r]);
                    acc[0][r] = _mm512_fmadd_ps(min[0][0], _mm512_set1_ps(sums[0]), acc[0][r]);
                    acc[0][r] = _mm512_fmadd_ps(min[0][1], _mm512_set1_ps(sums[1]), acc[0][r]);
                } else {
                    const __m512i dot = _mm512_add_epi32(
                        _mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
                    acc[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale[0][0], acc[0][r]);
                    acc[0][r] = _mm512_fmadd_ps(min[0][0], _mm512_set1_ps(sums[0] + sums[1]),
                                                acc[0][r]);
                }
            } else {
                // Each block's products in chains of high and low halves (and, for 16-input
                // sub-blocks, of each half group): the same integers as half_dot's partial
                // sums, added in another order (exact in int32).
                constexpr int H = T::halves ? 2 : 1;
                __m512i hs[NB][H], ls[NB][H];
                for (int n = 0; n < NB; ++n)
                    for (int h = 0; h < H; ++h) hs[n][h] = ls[n][h] = _mm512_setzero_si512();
                for (int q = 0; q < 8; ++q) {
                    const __m512i xh = _mm512_set1_epi32(high[q]), xl = _mm512_set1_epi32(low[q]);
                    const int h = H == 2 ? q / 4 : 0;
                    for (int n = 0; n < NB; ++n) {
                        hs[n][h] = _mm512_dpbusd_epi32(hs[n][h], levels[n][q], xh);
                        ls[n][h] = _mm512_dpbusd_epi32(ls[n][h], levels[n][q], xl);
                    }
                }
                for (int n = 0; n < NB; ++n) {
                    if constexpr (T::halves) {
                        const __m512i d0 =
                            _mm512_add_epi32(_mm512_slli_epi32(hs[n][0], 8), ls[n][0]);
                        const __m512i d1 =
                            _mm512_add_epi32(_mm512_slli_epi32(hs[n][1], 8), ls[n][1]);
                        acc[n][r] =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), scale[n][0], acc[n][r]);
                        acc[n][r] =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), scale[n][1], acc[n][r]);
                        acc[n][r] =
                            _mm512_fmadd_ps(min[n][0], _mm512_set1_ps(sums[0]), acc[n][r]);
                        acc[n][r] =
                            _mm512_fmadd_ps(min[n][1], _mm512_set1_ps(sums[1]), acc[n][r]);
                    } else {
                        const __m512i dot =
                            _mm512_add_epi32(_mm512_slli_epi32(hs[n][0], 8), ls[n][0]);
                        acc[n][r] =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale[n][0], acc[n][r]);
                        acc[n][r] = _mm512_fmadd_ps(min[n][0], _mm512_set1_ps(sums[0] + sums[1]),
                                                    acc[n][r]);
                    }
                }
            }
            }
        }
    }
    for (int n = 0; n < NB; ++n) {
        const __mmask16 live = tail_mask(w.out - 16 * (b + n));
        for (int r = 0; r < R; ++r) {
            float* out = y + (row0 + r) * ldy + 16 * (b + n);
            if constexpr (bytes)
                _mm512_mask_storeu_ps(out, live, acc[n][r]);
            else
                _mm512_mask_storeu_ps(out, live,
                                      _mm512_mul_ps(acc[n][r], _mm512_set1_ps(x.scales[row0 + r])));
        }
    }
}

// Blocks taken two at a time where that pays: 8-bit levels take 16 registers a block
// alone, and AVX2 has 16 registers in all.
template <int F>
constexpr int kPairedBlocks =
#ifdef MH_AVX2
    1;
#else
    Format<F>::bits == 8 ? 1 : 2;
#endif

// R rows times the blocks of outputs begin .. end (block-aligned begin) of this linear.
template <int R, int F, typename Rows>
void q_tile(const Rows& x, int64_t row0, const QLinear& w, int64_t begin, int64_t end,
            float* y, int64_t ldy) {
    constexpr int NB = kPairedBlocks<F>;
    const int64_t last = (end + 15) / 16;
    int64_t b = begin / 16;
    for (; b + NB <= last; b += NB) q_blocks<R, F, NB>(x, row0, w, b, y, ldy);
    for (; b < last; ++b) q_blocks<R, F, 1>(x, row0, w, b, y, ldy);
}

#ifndef MH_AVX2
// 8-bit activations (ByteRows) against one block of 16 outputs whose tiles are already
// unpacked (a panel, see byte_panels): levels [groups, 8 registers of 64 bytes], params
// [groups, H, scale and minimum of 16 floats] (H = 2 for 16-input sub-blocks). R rows from
// row0. Each row's group is one chain of VNNI products per sub-block (inputs broadcast from
// memory), then its float terms in one chain: the minimums times the rounded inputs' integer
// sums, plus each sub-block's product times its scales, all times the row's group scale
// (4 vector operations a group where q_blocks takes 5, and no unpacking). The same
// instructions for a row whatever R and its neighbours are.
template <int R, int H>
void byte_panel_rows(const ByteRows& x, int64_t row0, const uint8_t* levels,
                     const float* params, float* y, int64_t ldy, __mmask16 live) {
    constexpr int J = R < 4 ? R : 4;  // rows whose product chains interleave
    const int64_t groups = x.groups, sixteens = x.padded / 16;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i w[8];
        for (int q = 0; q < 8; ++q)
            w[q] = _mm512_load_si512(levels + 512 * g + 64 * q);
        const float* p = params + 32 * H * g;
        const __m512 scale0 = _mm512_load_ps(p), min0 = _mm512_load_ps(p + 16);
#pragma GCC unroll 16
        for (int r0 = 0; r0 < R; r0 += J) {
            const int32_t* q[J];
            for (int j = 0; j < J; ++j)
                q[j] = reinterpret_cast<const int32_t*>(x.q + (row0 + r0 + j) * x.padded + 32 * g);
            // dot[j][h]: row r0 + j's sub-block h (both halves in one chain where H == 1)
            __m512i dot[J][H];
            for (int j = 0; j < J; ++j)
                for (int h = 0; h < H; ++h) dot[j][h] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int k = 0; k < 8; ++k)
#pragma GCC unroll 4
                for (int j = 0; j < J; ++j) {
                    const int h = H == 2 ? k / 4 : 0;
                    dot[j][h] = _mm512_dpbusd_epi32(dot[j][h], w[k], _mm512_set1_epi32(q[j][k]));
                }
#pragma GCC unroll 4
            for (int j = 0; j < J; ++j) {
                const int64_t row = row0 + r0 + j;
                const __m512 group_scale = _mm512_set1_ps(x.scales[row * groups + g]);
                __m512 t;
                if constexpr (H == 1) {
                    t = _mm512_mul_ps(min0, _mm512_set1_ps(x.totals[row * groups + g]));
                    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][0]), scale0, t);
                } else {
                    const float* counts = x.counts + row * sixteens + 2 * g;
                    t = _mm512_mul_ps(min0, _mm512_set1_ps(counts[0]));
                    t = _mm512_fmadd_ps(_mm512_load_ps(p + 48), _mm512_set1_ps(counts[1]), t);
                    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][0]), scale0, t);
                    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][1]), _mm512_load_ps(p + 32), t);
                }
                acc[r0 + j] = _mm512_fmadd_ps(t, group_scale, acc[r0 + j]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(y + (row0 + r) * ldy, live, acc[r]);
}

// A block's tiles unpacked into a panel for byte_panel_rows: levels as unpack's registers,
// scales and minimums as tile_params's.
template <int F>
void unpack_panel(const QLinear& w, int64_t b, int64_t groups, uint8_t* levels, float* params) {
    using T = Format<F>;
    constexpr int H = T::halves ? 2 : 1;
    constexpr int64_t tile = tile_bytes(T::bits), pbytes = param_bytes<F>();
    __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = b * groups + g;
        __m512i unpacked[kRegisters<T::bits>];
        unpack<T::bits>(w.data + at * tile, unpacked);
        for (int q = 0; q < 8; ++q) _mm512_store_si512(levels + 512 * g + 64 * q, unpacked[q]);
        if constexpr (T::params == kSuper) {
            if (g % 8 == 0) {
                const uint16_t* s = w.supers + (b * (groups / 8) + g / 8) * 32;
                d = fp16_to_ps(s);
                dmin = fp16_to_ps(s + 16);
            }
        }
        __m512 scale[2], min[2];
        tile_params<F>(w.params + at * pbytes, d, dmin, scale, min);
        float* p = params + 32 * H * g;
        _mm512_store_ps(p, scale[0]);
        _mm512_store_ps(p + 16, min[0]);
        if constexpr (H == 2) {
            _mm512_store_ps(p + 32, scale[1]);
            _mm512_store_ps(p + 48, min[1]);
        }
    }
}

// Rows at a time in byte_panel_rows: 16 accumulators, 8 levels and the group's parameters
// fill the 32 registers.
constexpr int kPanelRows = 16;

// y = x @ w.T for 8-bit rows: each task's blocks of outputs are unpacked once per chunk of
// rows (about 256 KB of the rows' bytes, kept in L2 while the blocks pass over them) and
// every row of the chunk reads the unpacked panel, where q_blocks unpacks a tile for each 8
// rows. Tasks are runs of blocks handed out as threads come free, as by_tiles's.
template <int F>
void byte_panels(const ByteRows& x, int64_t rows, const QLinear& w, float* y, int64_t ldy,
                 int threads) {
    constexpr int H = Format<F>::halves ? 2 : 1;
    const int64_t groups = x.groups, blocks = (w.out + 15) / 16;
    const int64_t share = (blocks + 8 * threads - 1) / (8 * threads);
    const int64_t chunk_rows = std::clamp<int64_t>((256 * 1024 / x.padded) / 16 * 16, 16, 512);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t first = 0; first < blocks; first += share) {
        thread_local std::vector<uint8_t> panel;
        const size_t level_bytes = 512 * groups, param_bytes = 128 * H * groups;
        if (panel.size() < level_bytes + param_bytes + 64) panel.resize(level_bytes + param_bytes + 64);
        uint8_t* levels =
            panel.data() + (64 - reinterpret_cast<uintptr_t>(panel.data()) % 64) % 64;
        float* params = reinterpret_cast<float*>(levels + level_bytes);
        const int64_t last = std::min(blocks, first + share);
        for (int64_t row0 = 0; row0 < rows; row0 += chunk_rows) {
            const int64_t end = std::min(rows, row0 + chunk_rows);
            for (int64_t b = first; b < last; ++b) {
                unpack_panel<F>(w, b, groups, levels, params);
                const __mmask16 live = tail_mask(w.out - 16 * b);
                float* out = y + 16 * b;
                int64_t r = row0;
                for (; r + kPanelRows <= end; r += kPanelRows)
                    byte_panel_rows<kPanelRows, H>(x, r, levels, params, out, ldy, live);
                if (r + 8 <= end) byte_panel_rows<8, H>(x, r, levels, params, out, ldy, live), r += 8;
                if (r + 4 <= end) byte_panel_rows<4, H>(x, r, levels, params, out, ldy, live), r += 4;
                if (r + 2 <= end) byte_panel_rows<2, H>(x, r, levels, params, out, ldy, live), r += 2;
                if (r < end) byte_panel_rows<1, H>(x, r, levels, params, out, ldy, live);
            }
        }
    }
}
#endif

// R rows of fp32 x [rows, padded] times a block of outputs' 16-bit float weights: exact
// fp32 products of the weights as stored.
template <int R, int F>
void float_tile(const float* x, int64_t row0, const QLinear& w, int64_t begin, int64_t end,
                float* y, int64_t ldy) {
    constexpr int64_t tile = float_tile_bytes(F);
    const int64_t groups = w.padded / 32;
    for (int64_t b = begin / 16; b < (end + 15) / 16; ++b) {
        __m512 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t* t = w.data + (b * groups + g) * tile;
            for (int64_t line = 0; line < tile; line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(t + kAhead * tile + line),
                             _MM_HINT_T0);
            for (int i = 0; i < 32; ++i) {
                __m512 wv;
                if constexpr (F == kF32) {
                    wv = _mm512_loadu_ps(reinterpret_cast<const float*>(t) + 16 * i);
                } else if constexpr (F == kF16) {
                    wv = fp16_to_ps(t + 32 * i);
                } else {
                    wv = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * i))),
                        16));
                }
                for (int r = 0; r < R; ++r)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[(row0 + r) * w.padded + 32 * g + i]),
                                             wv, acc[r]);
            }
        }
        const __mmask16 live = tail_mask(w.out - 16 * b);
        for (int r = 0; r < R; ++r)
            _mm512_mask_storeu_ps(y + (row0 + r) * ldy + 16 * b, live, acc[r]);
    }
}

template <int F, typename Rows>
void q_matmul(const Rows& x, int64_t rows, const QLinear& w, float* y, int64_t ldy,
              int threads) {
    by_tiles(rows, w.out, threads, [&](int64_t row0, auto r, int64_t begin, int64_t end) {
        q_tile<decltype(r)::value, F>(x, row0, w, begin, end, y, ldy);
    });
}

template <int F>
void float_matmul(const float* x, int64_t rows, const QLinear& w, float* y, int64_t ldy,
                  int threads) {
    by_tiles(rows, w.out, threads, [&](int64_t row0, auto r, int64_t begin, int64_t end) {
        float_tile<decltype(r)::value, F>(x, row0, w, begin, end, y, ldy);
    });
}

bool is_float_format(int32_t format) {
    return format == kF32 || format == kF16 || format == kBF16;
}

// y[:, 0 .. w.out) (rows of ldy floats) = x @ w.T for a quantized w, x already rounded (to
// 16 bits, RoundedRows, or to 8, ByteRows).
template <typename Rows>
void qlinear_rounded(const Rows& x, int64_t rows, const QLinear& w, float* y,
                     int64_t ldy, int threads) {
    switch (w.format) {
        case kQ4_0: return q_matmul<kQ4_0>(x, rows, w, y, ldy, threads);
        case kQ4_1: return q_matmul<kQ4_1>(x, rows, w, y, ldy, threads);
        case kQ5_0: return q_matmul<kQ5_0>(x, rows, w, y, ldy, threads);
        case kQ5_1: return q_matmul<kQ5_1>(x, rows, w, y, ldy, threads);
        case kQ8_0: return q_matmul<kQ8_0>(x, rows, w, y, ldy, threads);
        case kQ2_K: return q_matmul<kQ2_K>(x, rows, w, y, ldy, threads);
        case kQ3_K: return q_matmul<kQ3_K>(x, rows, w, y, ldy, threads);
        case kQ4_K: return q_matmul<kQ4_K>(x, rows, w, y, ldy, threads);
        case kQ5_K: return q_matmul<kQ5_K>(x, rows, w, y, ldy, threads);
        case kQ6_K: return q_matmul<kQ6_K>(x, rows, w, y, ldy, threads);
        default: return;
    }
}

// y (rows of ldy floats) = x [rows, padded] @ w.T, any format.
void qlinear(const float* x, int64_t rows, const QLinear& w, float* y, int64_t ldy,
             int threads) {
    if (w.format == kF32) return float_matmul<kF32>(x, rows, w, y, ldy, threads);
    if (w.format == kF16) return float_matmul<kF16>(x, rows, w, y, ldy, threads);
    if (w.format == kBF16) return float_matmul<kBF16>(x, rows, w, y, ldy, threads);
    qlinear_rounded(round_rows(x, rows, w.padded), rows, w, y, ldy, threads);
}

// qlinear with a quantized w's activations rounded to 8 bits (ByteRows); float weights as
// qlinear's.
void qlinear_bytes(const float* x, int64_t rows, const QLinear& w, float* y, int64_t ldy,
                   int threads) {
    if (is_float_format(w.format)) return qlinear(x, rows, w, y, ldy, threads);
    const ByteRows bytes = byte_rows(x, rows, w.padded);
#ifndef MH_AVX2
    {  // every row count alike: a row's result never depends on the rows beside it
        switch (w.format) {
            case kQ4_0: return byte_panels<kQ4_0>(bytes, rows, w, y, ldy, threads);
            case kQ4_1: return byte_panels<kQ4_1>(bytes, rows, w, y, ldy, threads);
            case kQ5_0: return byte_panels<kQ5_0>(bytes, rows, w, y, ldy, threads);
            case kQ5_1: return byte_panels<kQ5_1>(bytes, rows, w, y, ldy, threads);
            case kQ8_0: return byte_panels<kQ8_0>(bytes, rows, w, y, ldy, threads);
            case kQ2_K: return byte_panels<kQ2_K>(bytes, rows, w, y, ldy, threads);
            case kQ3_K: return byte_panels<kQ3_K>(bytes, rows, w, y, ldy, threads);
            case kQ4_K: return byte_panels<kQ4_K>(bytes, rows, w, y, ldy, threads);
            case kQ5_K: return byte_panels<kQ5_K>(bytes, rows, w, y, ldy, threads);
            case kQ6_K: return byte_panels<kQ6_K>(bytes, rows, w, y, ldy, threads);
            default: return;
        }
    }
#endif
    qlinear_rounded(bytes, rows, w, y, ldy, threads);
}

// Level i (0 .. 31) of output o (0 .. 15) in a tile of `bits` levels (scalar: row lookups).
int level_at(const uint8_t* t, int bits, int o, int i) {
    const int q = i / 4, k = i % 4, byte = 4 * o + k;
    if (bits == 8) return t[64 * q + byte];
    int level = 0;
    if (bits >= 4) {
        const uint8_t v = t[64 * (q / 2) + byte];
        level = q % 2 == 0 ? v & 0x0F : v >> 4;
        if (bits == 5) level |= ((t[256 + byte] >> q) & 1) << 4;
        if (bits == 6) level |= ((t[256 + 64 * (q / 4) + byte] >> (2 * (q % 4))) & 3) << 4;
        return level;
    }
    level = (t[64 * (q / 4) + byte] >> (2 * (q % 4))) & 3;
    if (bits == 3) level |= ((t[128 + byte] >> q) & 1) << 2;
    return level;
}

float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// Output `row`'s weights, dequantized: out [padded] fp32.
template <int F>
void dequantize_row(const QLinear& w, int64_t row, float* out) {
    using T = Format<F>;
    constexpr int64_t tile = tile_bytes(T::bits), pbytes = param_bytes<F>();
    const int64_t groups = w.padded / 32, b = row / 16;
    const int o = static_cast<int>(row % 16);
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* t = w.data + (b * groups + g) * tile;
        const uint8_t* p = w.params + (b * groups + g) * pbytes;
        for (int i = 0; i < 32; ++i) {
            const int h = T::halves ? i / 16 : 0;
            float scale, min;
            if constexpr (T::params == kDirect) {
                scale = half_to_float(reinterpret_cast<const uint16_t*>(p)[o]);
                min = half_to_float(reinterpret_cast<const uint16_t*>(p)[16 + o]);
            } else if constexpr (T::params == kDirectSymmetric) {
                scale = half_to_float(reinterpret_cast<const uint16_t*>(p)[o]);
                min = T::min_factor * scale;
            } else {
                const uint16_t* s = w.supers + (b * (groups / 8) + g / 8) * 32;
                constexpr int stride = T::sym ? 16 : 32;
                const float sc = static_cast<int8_t>(p[stride * h + o]);
                const float m = T::sym ? sc : static_cast<int8_t>(p[stride * h + 16 + o]);
                scale = half_to_float(s[o]) * sc;
                min = half_to_float(s[16 + o]) * m;
            }
            out[32 * g + i] = static_cast<float>(level_at(t, T::bits, o, i)) * scale + min;
        }
    }
}

template <int F>
void float_row(const QLinear& w, int64_t row, float* out) {
    constexpr int64_t tile = float_tile_bytes(F);
    const int64_t groups = w.padded / 32, b = row / 16, o = row % 16;
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* t = w.data + (b * groups + g) * tile;
        for (int i = 0; i < 32; ++i) {
            float v;
            if constexpr (F == kF32) {
                std::memcpy(&v, t + 4 * (16 * i + o), 4);
            } else {
                uint16_t h;
                std::memcpy(&h, t + 2 * (16 * i + o), 2);
                const uint32_t bits = static_cast<uint32_t>(h) << 16;
                if constexpr (F == kF16) v = half_to_float(h);
                else std::memcpy(&v, &bits, 4);
            }
            out[32 * g + i] = v;
        }
    }
}

}  // namespace

// y [rows, ldy] (columns 0 .. w->out) = x [rows, w->padded] @ w.T (the dequantized weight).
extern "C" void mh_qmatmul(const float* x, int64_t rows, const QLinear* w, float* y,
                           int64_t ldy, int threads) {
    qlinear(x, rows, *w, y, ldy, threads);
}

// mh_qmatmul with 8-bit activations (ByteRows: one scale each 32 inputs) for a quantized w:
// prompt rows whose logits are not read (models/kernels/packed.py).
extern "C" void mh_qmatmul_bytes(const float* x, int64_t rows, const QLinear* w, float* y,
                                 int64_t ldy, int threads) {
    qlinear_bytes(x, rows, *w, y, ldy, threads);
}

// out [count, w->padded] = the dequantized weight's rows `ids` (embedding lookups).
extern "C" void mh_qrows(const QLinear* w, const int64_t* ids, int64_t count, float* out,
                         int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && count > 16)
    for (int64_t n = 0; n < count; ++n) {
        float* row = out + n * w->padded;
        switch (w->format) {
            case kQ4_0: dequantize_row<kQ4_0>(*w, ids[n], row); break;
            case kQ4_1: dequantize_row<kQ4_1>(*w, ids[n], row); break;
            case kQ5_0: dequantize_row<kQ5_0>(*w, ids[n], row); break;
            case kQ5_1: dequantize_row<kQ5_1>(*w, ids[n], row); break;
            case kQ8_0: dequantize_row<kQ8_0>(*w, ids[n], row); break;
            case kQ2_K: dequantize_row<kQ2_K>(*w, ids[n], row); break;
            case kQ3_K: dequantize_row<kQ3_K>(*w, ids[n], row); break;
            case kQ4_K: dequantize_row<kQ4_K>(*w, ids[n], row); break;
            case kQ5_K: dequantize_row<kQ5_K>(*w, ids[n], row); break;
            case kQ6_K: dequantize_row<kQ6_K>(*w, ids[n], row); break;
            case kF32: float_row<kF32>(*w, ids[n], row); break;
            case kF16: float_row<kF16>(*w, ids[n], row); break;
            case kBF16: float_row<kBF16>(*w, ids[n], row); break;
            default: break;
        }
    }
}

#include "native_repack.h"
