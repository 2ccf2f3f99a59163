// The AVX-512 intrinsics native_kernels.cpp uses, on AVX2 + FMA + F16C: each 512-bit register
// is a pair of 256-bit ones, each 16-lane mask a uint16_t as before. Included (with MH_AVX2
// defined) by the build for CPUs without AVX-512 VNNI, such as AMD's Zen 3; the kernels' source
// stays one, and so do their layouts, their order of operations per row and their results up
// to the order of fp32 sums. VNNI's byte dot products have no counterpart here: levels
// take dpbusd_nibble_pair below.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace mh_avx2 {

struct F16 {
    __m256 lo, hi;
};

struct I16 {  // 16 int32 lanes, or 64 bytes
    __m256i lo, hi;
};

// All ones in the lanes of `bits`' low 8 bits.
inline __m256i lane_mask(unsigned bits) {
    const __m256i each = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), each),
                              each);
}

inline F16 set1_ps(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F16 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 loadu_ps(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F16 load_ps(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline void storeu_ps(float* p, F16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
inline void store_ps(float* p, F16 v) {
    _mm256_store_ps(p, v.lo);
    _mm256_store_ps(p + 8, v.hi);
}
// Masked loads and stores never touch the lanes outside the mask (no fault past an array).
inline F16 maskz_loadu_ps(uint16_t m, const float* p) {
    if (m == 0xFFFF) return loadu_ps(p);
    return {_mm256_maskload_ps(p, lane_mask(m & 0xFF)),
            _mm256_maskload_ps(p + 8, lane_mask(m >> 8))};
}
inline F16 mask_loadu_ps(F16 src, uint16_t m, const float* p) {
    if (m == 0xFFFF) return loadu_ps(p);
    const F16 v = maskz_loadu_ps(m, p);
    return {_mm256_blendv_ps(src.lo, v.lo, _mm256_castsi256_ps(lane_mask(m & 0xFF))),
            _mm256_blendv_ps(src.hi, v.hi, _mm256_castsi256_ps(lane_mask(m >> 8)))};
}
inline void mask_storeu_ps(float* p, uint16_t m, F16 v) {
    if (m == 0xFFFF) return storeu_ps(p, v);
    _mm256_maskstore_ps(p, lane_mask(m & 0xFF), v.lo);
    _mm256_maskstore_ps(p + 8, lane_mask(m >> 8), v.hi);
}
inline F16 maskz_mov_ps(uint16_t m, F16 v) {
    return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(lane_mask(m & 0xFF))),
            _mm256_and_ps(v.hi, _mm256_castsi256_ps(lane_mask(m >> 8)))};
}

inline F16 add_ps(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 sub_ps(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F16 mul_ps(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 div_ps(F16 a, F16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F16 max_ps(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 and_ps(F16 a, F16 b) { return {_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)}; }
inline F16 fmadd_ps(F16 a, F16 b, F16 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

inline float reduce_add_ps(F16 v) {
    const __m256 s = _mm256_add_ps(v.lo, v.hi);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float reduce_max_ps(F16 v) {
    const __m256 s = _mm256_max_ps(v.lo, v.hi);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline float mask_reduce_max_ps(uint16_t m, F16 v) {
    const F16 none = set1_ps(-__builtin_inff());
    return reduce_max_ps({_mm256_blendv_ps(none.lo, v.lo, _mm256_castsi256_ps(lane_mask(m & 0xFF))),
                          _mm256_blendv_ps(none.hi, v.hi, _mm256_castsi256_ps(lane_mask(m >> 8)))});
}

template <int P>
inline uint16_t cmp_ps_mask(F16 a, F16 b) {
    return static_cast<uint16_t>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, P)) |
                                 (_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, P)) << 8));
}

// Per 128-bit lane, as on AVX-512.
inline F16 unpacklo_ps(F16 a, F16 b) {
    return {_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpacklo_ps(a.hi, b.hi)};
}
inline F16 unpackhi_ps(F16 a, F16 b) {
    return {_mm256_unpackhi_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.hi, b.hi)};
}
template <int S>
inline F16 shuffle_ps(F16 a, F16 b) {
    return {_mm256_shuffle_ps(a.lo, b.lo, S), _mm256_shuffle_ps(a.hi, b.hi, S)};
}
// 128-bit lanes: (a's even ones, b's even ones) for 0x88, the odd ones for 0xDD.
template <int S>
inline F16 shuffle_f32x4(F16 a, F16 b) {
    static_assert(S == 0x88 || S == 0xDD, "the kernels use these two only");
    constexpr int pick = S == 0x88 ? 0x20 : 0x31;
    return {_mm256_permute2f128_ps(a.lo, a.hi, pick), _mm256_permute2f128_ps(b.lo, b.hi, pick)};
}

template <int R>
inline F16 roundscale_ps(F16 v) {
    static_assert((R & 0xF0) == 0, "no scale: a plain rounding");
    return {_mm256_round_ps(v.lo, R), _mm256_round_ps(v.hi, R)};
}
// 2^n for integral n in [-126, 127].
inline __m256 power_of_two(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
// v * 2^n for integral n: two factors in the normal range, so one rounding where the result is
// subnormal (n clamped where the result is 0 or infinite anyway; a NaN v stays NaN).
inline __m256 scalef(__m256 v, __m256 n) {
    n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-252.0f)), _mm256_set1_ps(254.0f));
    const __m256 half = _mm256_floor_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)));
    return _mm256_mul_ps(_mm256_mul_ps(v, power_of_two(half)),
                         power_of_two(_mm256_sub_ps(n, half)));
}
inline F16 scalef_ps(F16 v, F16 n) { return {scalef(v.lo, n.lo), scalef(v.hi, n.hi)}; }

inline F16 cvtph_ps(__m256i h) {
    return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)),
            _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
template <int R>
inline __m256i cvtps_ph(F16 v) {
    return _mm256_set_m128i(_mm256_cvtps_ph(v.hi, R), _mm256_cvtps_ph(v.lo, R));
}

inline I16 setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 set1_epi32(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline I16 set1_epi8(char v) { return {_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
inline I16 load_si512(const void* p) {
    const __m256i* q = static_cast<const __m256i*>(p);
    return {_mm256_load_si256(q), _mm256_load_si256(q + 1)};
}
inline I16 loadu_si512(const void* p) {
    const __m256i* q = static_cast<const __m256i*>(p);
    return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline I16 and_si512(I16 a, I16 b) {
    return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)};
}
inline I16 or_si512(I16 a, I16 b) {
    return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)};
}
template <int S>
inline I16 slli_epi16(I16 a) { return {_mm256_slli_epi16(a.lo, S), _mm256_slli_epi16(a.hi, S)}; }
// 16 bytes (int8) or 16 uint16 widened to 16 int32 lanes.
inline I16 cvtepi8_epi32(__m128i v) {
    return {_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v))};
}
inline I16 cvtepu16_epi32(__m256i v) {
    return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)),
            _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1))};
}
inline I16 add_epi32(I16 a, I16 b) {
    return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
inline I16 sub_epi32(I16 a, I16 b) {
    return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)};
}
inline I16 min_epi32(I16 a, I16 b) {
    return {_mm256_min_epi32(a.lo, b.lo), _mm256_min_epi32(a.hi, b.hi)};
}
inline I16 max_epi32(I16 a, I16 b) {
    return {_mm256_max_epi32(a.lo, b.lo), _mm256_max_epi32(a.hi, b.hi)};
}
template <int S>
inline I16 srli_epi16(I16 a) { return {_mm256_srli_epi16(a.lo, S), _mm256_srli_epi16(a.hi, S)}; }
template <int S>
inline I16 slli_epi32(I16 a) { return {_mm256_slli_epi32(a.lo, S), _mm256_slli_epi32(a.hi, S)}; }
inline I16 cvtps_epi32(F16 v) { return {_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi)}; }
inline F16 cvtepi32_ps(I16 v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
inline F16 castsi512_ps(I16 v) { return {_mm256_castsi256_ps(v.lo), _mm256_castsi256_ps(v.hi)}; }
inline int32_t reduce_add_epi32(I16 v) {
    const __m256i s = _mm256_add_epi32(v.lo, v.hi);
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}
// Each lane's low byte (truncation, as vpmovdb).
inline __m128i cvtepi32_epi8(I16 v) {
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1,
                                               -1, -1, -1, -1, -1, -1);
    const __m256i gather = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
    const __m256i a = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v.lo, low_bytes), gather);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v.hi, low_bytes), gather);
    return _mm_unpacklo_epi64(_mm256_castsi256_si128(a), _mm256_castsi256_si128(b));
}

// acc + u . s + v . t per int32 lane (4 byte products each) for unsigned bytes u, v < 64
// (levels of up to 6 bits) and signed s, t in -127 .. 127 (round_rows): a vpmaddubsw pair is
// at most 2 x 63 x 127 = 16,002 in magnitude, so the two sum exactly in int16 (32,004) before
// one vpmaddwd widens them. 8-bit levels go through as two nibbles (native_qlinear.h).
inline __m256i dpbusd_nibble_pair(__m256i acc, __m256i u, __m256i s, __m256i v, __m256i t) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(v, t));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline I16 dpbusd_nibble_pair(I16 acc, I16 u, I16 s, I16 v, I16 t) {
    return {dpbusd_nibble_pair(acc.lo, u.lo, s.lo, v.lo, t.lo),
            dpbusd_nibble_pair(acc.hi, u.hi, s.hi, v.hi, t.hi)};
}

}  // namespace mh_avx2

// The kernels' spelling, mapped onto the pairs above.
#define __m512 mh_avx2::F16
#define __m512i mh_avx2::I16
#define _mm512_set1_ps mh_avx2::set1_ps
#define _mm512_setzero_ps mh_avx2::setzero_ps
#define _mm512_loadu_ps mh_avx2::loadu_ps
#define _mm512_load_ps mh_avx2::load_ps
#define _mm512_storeu_ps mh_avx2::storeu_ps
#define _mm512_store_ps mh_avx2::store_ps
#define _mm512_maskz_loadu_ps mh_avx2::maskz_loadu_ps
#define _mm512_mask_loadu_ps mh_avx2::mask_loadu_ps
#define _mm512_mask_storeu_ps mh_avx2::mask_storeu_ps
#define _mm512_maskz_mov_ps mh_avx2::maskz_mov_ps
#define _mm512_add_ps mh_avx2::add_ps
#define _mm512_sub_ps mh_avx2::sub_ps
#define _mm512_mul_ps mh_avx2::mul_ps
#define _mm512_div_ps mh_avx2::div_ps
#define _mm512_max_ps mh_avx2::max_ps
#define _mm512_and_ps mh_avx2::and_ps
#define _mm512_fmadd_ps mh_avx2::fmadd_ps
#define _mm512_reduce_add_ps mh_avx2::reduce_add_ps
#define _mm512_reduce_max_ps mh_avx2::reduce_max_ps
#define _mm512_mask_reduce_max_ps mh_avx2::mask_reduce_max_ps
#define _mm512_cmp_ps_mask(a, b, p) mh_avx2::cmp_ps_mask<(p)>((a), (b))
#define _mm512_mask_cmp_ps_mask(m, a, b, p) \
    static_cast<uint16_t>((m) & mh_avx2::cmp_ps_mask<(p)>((a), (b)))
#define _mm512_unpacklo_ps mh_avx2::unpacklo_ps
#define _mm512_unpackhi_ps mh_avx2::unpackhi_ps
#define _mm512_shuffle_ps(a, b, s) mh_avx2::shuffle_ps<(s)>((a), (b))
#define _mm512_shuffle_f32x4(a, b, s) mh_avx2::shuffle_f32x4<(s)>((a), (b))
#define _mm512_roundscale_ps(v, r) mh_avx2::roundscale_ps<(r)>(v)
#define _mm512_scalef_ps mh_avx2::scalef_ps
#define _mm512_cvtph_ps mh_avx2::cvtph_ps
#define _mm512_cvtps_ph(v, r) mh_avx2::cvtps_ph<(r)>(v)
#define _mm512_setzero_si512 mh_avx2::setzero_si512
#define _mm512_set1_epi32 mh_avx2::set1_epi32
#define _mm512_set1_epi8 mh_avx2::set1_epi8
#define _mm512_load_si512 mh_avx2::load_si512
#define _mm512_loadu_si512 mh_avx2::loadu_si512
#define _mm512_and_si512 mh_avx2::and_si512
#define _mm512_or_si512 mh_avx2::or_si512
#define _mm512_slli_epi16(a, s) mh_avx2::slli_epi16<(s)>(a)
#define _mm512_cvtepi8_epi32 mh_avx2::cvtepi8_epi32
#define _mm512_cvtepu16_epi32 mh_avx2::cvtepu16_epi32
#define _mm512_add_epi32 mh_avx2::add_epi32
#define _mm512_sub_epi32 mh_avx2::sub_epi32
#define _mm512_min_epi32 mh_avx2::min_epi32
#define _mm512_max_epi32 mh_avx2::max_epi32
#define _mm512_srli_epi16(a, s) mh_avx2::srli_epi16<(s)>(a)
#define _mm512_slli_epi32(a, s) mh_avx2::slli_epi32<(s)>(a)
#define _mm512_cvtps_epi32 mh_avx2::cvtps_epi32
#define _mm512_cvtepi32_ps mh_avx2::cvtepi32_ps
#define _mm512_castsi512_ps mh_avx2::castsi512_ps
#define _mm512_reduce_add_epi32 mh_avx2::reduce_add_epi32
#define _mm512_cvtepi32_epi8 mh_avx2::cvtepi32_epi8
