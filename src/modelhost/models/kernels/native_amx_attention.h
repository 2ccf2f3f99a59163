// A long prompt's bf16 attention on AMX tiles (Intel Sapphire Rapids and later): the queries of
// a panel against every key before it, without a mask (models/kernels/bf16_attention.py merges
// the result with its panel's own masked keys by their log-sum-exps). PyTorch's CPU flash
// attention multiplies on the same tiles, but at a 64-wide head spends most of its time in its
// softmax's separate passes (~620-740 GFLOP/s on this project's 2-core machine, against 2,280
// for a bf16 GEMM); here each block of scores is one fused pass: scale, subtract, 2^x on a
// short polynomial, sum and round to bf16 for the values' product.
//
// Layout: the keys are read from the paged pool once a call, rounded to bf16 and laid out as
// the tiles' B operand of Q . K^T (pairs of dimensions a row, 16 keys a tile), the values as
// that of P . V (pairs of keys a row, 16 dimensions a tile): no gathered copy of the context.
// Each thread takes a fixed share of the query blocks (32 queries) and walks the keys a span
// at a time (what fits half a core's 2 MB cache), every block of its share before the next
// span, so a key is read from memory once a thread, not once a block. A query's result
// depends only on its query and the keys, taken in order of position kAmxKeys at a time,
// whatever the other queries and the thread count are.
//
// Included by native_kernels.cpp inside its AVX-512 target region (not in the AVX2 build).

#pragma once

#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t kAmxQueries = 32;  // queries a block: two tiles' rows
constexpr int64_t kAmxKeys = 256;    // keys scored, exponentiated and multiplied together
constexpr int64_t kAmxSpanBytes = 512 * 1024;  // a span's packed keys and values

// Every tile 16 rows of 64 bytes: A (16 x 32 bf16), B (16 pairs x 16 x 2 bf16), C (16 x 16 fp32).
struct alignas(64) AmxTileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// 2^x in each lane for x <= 0: a cubic on x's fraction (relative error ~1e-4, well below the
// bf16 rounding of the probabilities it feeds), scaled by 2^floor(x).
__attribute__((target("avx512f"))) inline __m512 amx_exp2(__m512 x) {
    const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, whole);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(7.8024521e-2f), f, _mm512_set1_ps(2.2606716e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9583356e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992520e-1f));
    return _mm512_scalef_ps(p, whole);
}

// Where one KV head's keys and values sit in the paged pool (fp16 or fp32 slots of
// slot_width elements: every KV head's key, then every KV head's value).
struct AmxPagedHead {
    const void* pool;
    int kind;  // PoolKind: kPoolF32 or kPoolF16
    int64_t slot_width, key_offset, value_offset;
    const int64_t* table;
    int64_t block_size;
};

// `count` rows of dim elements from position `first` of a pool of T (fp32, or fp16 bits) at
// `offset` in each slot (a key's or a value's), as bf16 rows [count, dim] (rounded to nearest
// even in one instruction: native_bf16.h's bf16_lanes takes five, without AVX512-BF16).
template <typename T>
__attribute__((target("avx512bf16"))) void amx_rows(const AmxPagedHead& head, int64_t offset,
                                                     int64_t first, int64_t count, int64_t dim,
                                                     uint16_t* out) {
    const T* pool = static_cast<const T*>(head.pool);
    for (int64_t i = 0; i < count; ++i) {
        const T* row =
            key_at(pool, head.slot_width, offset, head.table, head.block_size, first + i);
        for (int64_t e = 0; e < dim; e += 16) {
            const __m256bh rounded = _mm512_cvtneps_pbh(load_cached(row + e));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * dim + e),
                                reinterpret_cast<__m256i>(rounded));
        }
    }
}

// The keys' rows (or the values' with `values`) of positions first .. first + count - 1.
void amx_rows(const AmxPagedHead& head, bool values, int64_t first, int64_t count, int64_t dim,
              uint16_t* out) {
    const int64_t offset = values ? head.value_offset : head.key_offset;
    if (head.kind == kPoolF16)
        amx_rows<uint16_t>(head, offset, first, count, dim, out);
    else
        amx_rows<float>(head, offset, first, count, dim, out);
}

// Keys 0 .. count - 1 as B tiles of Q . K^T: tile (16 keys, 32 dimensions) row r holds each
// key's dimensions 2r and 2r + 1.
void amx_lay_out_keys(const AmxPagedHead& head, int64_t count, int64_t dim, uint16_t* out) {
    const int64_t chunks = dim / 32, pairs = dim / 2;
    const __m512i stride = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(static_cast<int>(pairs)));
    alignas(64) uint16_t rows[16 * 256];
    const int* words = reinterpret_cast<const int*>(rows);
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < count / 16; ++tile) {
        amx_rows(head, false, tile * 16, 16, dim, rows);
        for (int64_t c = 0; c < chunks; ++c)
            for (int64_t r = 0; r < 16; ++r)
                _mm512_storeu_si512(out + ((tile * chunks + c) * 16 + r) * 32,
                                    _mm512_i32gather_epi32(stride, words + c * 16 + r, 4));
    }
}

// Values 0 .. count - 1 as B tiles of P . V: tile (32 keys, 16 dimensions) row r interleaves
// keys 2r and 2r + 1.
void amx_lay_out_values(const AmxPagedHead& head, int64_t count, int64_t dim, uint16_t* out) {
    const int64_t columns = dim / 16;
    alignas(64) uint16_t rows[32 * 256];
#pragma omp for schedule(static)
    for (int64_t chunk = 0; chunk < count / 32; ++chunk) {
        amx_rows(head, true, chunk * 32, 32, dim, rows);
        for (int64_t c = 0; c < columns; ++c)
            for (int64_t r = 0; r < 16; ++r) {
                const uint16_t* even = rows + 2 * r * dim + c * 16;
                const __m512i low = _mm512_cvtepu16_epi32(
                    _mm256_load_si256(reinterpret_cast<const __m256i*>(even)));
                const __m512i high = _mm512_cvtepu16_epi32(
                    _mm256_load_si256(reinterpret_cast<const __m256i*>(even + dim)));
                _mm512_storeu_si512(out + ((chunk * columns + c) * 16 + r) * 32,
                                    _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
            }
    }
}

// One block of 32 queries against keys k0 .. k0 + count - 1 (a multiple of 32, at most
// kAmxKeys), folded into its running maxima m (log2 units of the scaled scores), sums l and
// unnormalized outputs o [32, dim].
__attribute__((target("amx-tile,amx-bf16,avx512bf16"))) void amx_block(
    const uint16_t* queries, const uint16_t* keys, const uint16_t* values, int64_t k0,
    int64_t count, int64_t dim, float log2_scale, float* scores, uint16_t* probabilities,
    float* m, float* l, float* o) {
    const int64_t chunks = dim / 32, columns = dim / 16;
    for (int64_t j = 0; j < count; j += 32) {
        const int64_t tile = (k0 + j) / 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < chunks; ++c) {
            _tile_loadd(4, queries + c * 32, dim * 2);
            _tile_loadd(5, queries + 16 * dim + c * 32, dim * 2);
            _tile_loadd(6, keys + (tile * chunks + c) * 512, 64);
            _tile_loadd(7, keys + ((tile + 1) * chunks + c) * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, scores + j, kAmxKeys * 4);
        _tile_stored(1, scores + j + 16, kAmxKeys * 4);
        _tile_stored(2, scores + 16 * kAmxKeys + j, kAmxKeys * 4);
        _tile_stored(3, scores + 16 * kAmxKeys + j + 16, kAmxKeys * 4);
    }
    const __m512 to_log2 = _mm512_set1_ps(log2_scale);
    for (int64_t i = 0; i < kAmxQueries; ++i) {
        const float* row = scores + i * kAmxKeys;
        __m512 top = _mm512_loadu_ps(row);
        for (int64_t j = 16; j < count; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + j));
        const float peak = std::max(m[i], _mm512_reduce_max_ps(top) * log2_scale);
        const __m512 shift = _mm512_set1_ps(peak);
        __m512 sum = _mm512_setzero_ps();
        uint16_t* p = probabilities + i * kAmxKeys;
        for (int64_t j = 0; j < count; j += 32) {
            const __m512 a =
                amx_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), to_log2, shift));
            const __m512 b =
                amx_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(row + j + 16), to_log2, shift));
            sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
            _mm512_storeu_si512(p + j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
        }
        if (peak != m[i]) {  // a new maximum: what the row summed so far shrinks by 2^(old - new)
            const float shrink = std::exp2(m[i] - peak);
            l[i] *= shrink;
            const __m512 by = _mm512_set1_ps(shrink);
            for (float* e = o + i * dim; e < o + (i + 1) * dim; e += 16)
                _mm512_storeu_ps(e, _mm512_mul_ps(by, _mm512_loadu_ps(e)));
            m[i] = peak;
        }
        l[i] += _mm512_reduce_add_ps(sum);
    }
    for (int64_t c = 0; c < columns; c += 2) {
        _tile_loadd(0, o + c * 16, dim * 4);
        _tile_loadd(1, o + c * 16 + 16, dim * 4);
        _tile_loadd(2, o + 16 * dim + c * 16, dim * 4);
        _tile_loadd(3, o + 16 * dim + c * 16 + 16, dim * 4);
        for (int64_t j = 0; j < count; j += 32) {
            const int64_t chunk = (k0 + j) / 32;
            _tile_loadd(4, probabilities + j, kAmxKeys * 2);
            _tile_loadd(5, probabilities + 16 * kAmxKeys + j, kAmxKeys * 2);
            _tile_loadd(6, values + (chunk * columns + c) * 512, 64);
            _tile_loadd(7, values + (chunk * columns + c + 1) * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, o + c * 16, dim * 4);
        _tile_stored(1, o + c * 16 + 16, dim * 4);
        _tile_stored(2, o + 16 * dim + c * 16, dim * 4);
        _tile_stored(3, o + 16 * dim + c * 16 + 16, dim * 4);
    }
}

// This thread's share of the query blocks against every key, span by span; the tile
// configuration it found (PyTorch's brgemm keeps its own a thread) is put back after.
__attribute__((target("amx-tile,amx-bf16,avx512bf16"))) void amx_attend_share(
    const uint16_t* queries, int64_t first, int64_t last, const uint16_t* keys,
    const uint16_t* values, int64_t count, int64_t dim, float log2_scale, float* out,
    float* lse) {
    AmxTileConfig before, config;
    _tile_storeconfig(&before);
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    alignas(64) float scores[kAmxQueries * kAmxKeys];
    alignas(64) uint16_t probabilities[kAmxQueries * kAmxKeys];
    const int64_t rows = (last - first) * kAmxQueries;
    std::vector<float> o(rows * dim, 0.f), m(rows, -INFINITY), l(rows, 0.f);
    const int64_t span = std::max(kAmxKeys, kAmxSpanBytes / (4 * dim) / kAmxKeys * kAmxKeys);
    for (int64_t s0 = 0; s0 < count; s0 += span)
        for (int64_t b = first; b < last; ++b) {
            const int64_t at = (b - first) * kAmxQueries;
            for (int64_t k0 = s0; k0 < std::min(count, s0 + span); k0 += kAmxKeys)
                amx_block(queries + b * kAmxQueries * dim, keys, values, k0,
                          std::min(kAmxKeys, count - k0), dim, log2_scale, scores, probabilities,
                          m.data() + at, l.data() + at, o.data() + at * dim);
        }
    for (int64_t i = 0; i < rows; ++i) {
        const float inverse = 1.f / l[i];
        float* row = out + (first * kAmxQueries + i) * dim;
        for (int64_t e = 0; e < dim; ++e) row[e] = o[i * dim + e] * inverse;
        lse[first * kAmxQueries + i] = (m[i] + std::log2(l[i])) * 0.6931471805599453f;
    }
    if (before.palette != 0)
        _tile_loadconfig(&before);
    else
        _tile_release();
}

}  // namespace

// Whether this CPU and kernel run AMX bf16 tiles for this process (asked of Linux once).
extern "C" int mh_amx_ready() {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512bf16")) return 0;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// out [queries, dim] fp32 = softmax(scale * Q . K^T) . V and lse [queries] its rows' natural
// log-sum-exps of the scaled scores, for bf16 queries [queries, dim] (contiguous, a multiple of
// 32) against the keys and values of positions 0 .. key_count - 1 (a multiple of 32) of one KV
// head in a paged pool (fp32 or fp16, PoolKind; slots of 2 * kv_heads * dim elements, a
// sequence's block table): dim a multiple of 32 up to 256.
extern "C" void mh_amx_attention(const uint16_t* queries, int64_t query_count, const void* pool,
                                 int kind, int64_t kv_heads, int64_t kv_head, const int64_t* table,
                                 int64_t block_size, int64_t key_count, int64_t dim, float scale,
                                 float* out, float* lse, int threads) {
    const AmxPagedHead head{pool, kind, 2 * kv_heads * dim, kv_head * dim,
                            (kv_heads + kv_head) * dim, table, block_size};
    thread_local std::vector<uint16_t> laid_out;
    if (static_cast<int64_t>(laid_out.size()) < 2 * key_count * dim)
        laid_out.resize(2 * key_count * dim);
    uint16_t* tiled_keys = laid_out.data();
    uint16_t* tiled_values = tiled_keys + key_count * dim;
    const int64_t blocks = query_count / kAmxQueries;
    const float log2_scale = scale * 1.4426950408889634f;
#pragma omp parallel num_threads(threads)
    {
        amx_lay_out_keys(head, key_count, dim, tiled_keys);
        amx_lay_out_values(head, key_count, dim, tiled_values);  // each ends in a barrier
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t first = blocks * t / n, last = blocks * (t + 1) / n;
        if (first < last)
            amx_attend_share(queries, first, last, tiled_keys, tiled_values, key_count, dim,
                             log2_scale, out, lse);
    }
}
