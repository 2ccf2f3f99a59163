// A prompt step's attention, tiled: the queries of several consecutive tokens of one sequence
// (and the query heads that share a KV head) against each block of 16 keys together, where
// mh_paged_attention takes one token's heads at a time. Each key and value is read (and
// converted from fp16) once for a tile of up to 16 query vectors instead of once per token,
// and no work is done above the causal diagonal. Softmax online (a running maximum and sum a
// query, FlashAttention's): a query's result depends only on its own keys, taken in order of
// position 16 at a time, whatever tile it shares and whatever the thread count is.
//
// Included by native_kernels.cpp after store_keys (the norm, rotary and store it shares with
// mh_paged_attention). Causal attention only: no sliding window, no soft-capping (those steps
// keep mh_paged_attention or SDPA).

#pragma once

#include "native_common.h"

namespace {

constexpr int64_t kKeyBlock = 16;  // keys scored together: one register of scores a query

// Keys of positions 0 .. count - 1 (a sequence's table, one KV head) copied as fp32 into
// `transposed` [blocks of 16][dim][16] (lane i: the block's key i; zeros past count) and the
// values into `values` [count][dim].
template <typename T>
void gather_keys(const T* pool, int64_t slot_width, int64_t key_offset, int64_t value_shift,
                 const int64_t* table, int64_t block_size, int64_t count, int64_t dim,
                 float* transposed, float* values) {
    const int64_t blocks = (count + kKeyBlock - 1) / kKeyBlock;
    std::fill(transposed, transposed + blocks * dim * kKeyBlock, 0.0f);
    for (int64_t p = 0; p < count; ++p) {
        const T* key =
            pool + (table[p / block_size] * block_size + p % block_size) * slot_width + key_offset;
        float* column = transposed + (p / kKeyBlock) * dim * kKeyBlock + p % kKeyBlock;
        float* value = values + p * dim;
        for (int64_t e = 0; e < dim; e += 16) {
            alignas(64) float k[16];
            _mm512_store_ps(k, load_cached(key + e));
            for (int i = 0; i < 16; ++i) column[(e + i) * kKeyBlock] = k[i];
            _mm512_storeu_ps(value + e, load_cached(key + value_shift + e));
        }
    }
}

// Attention of M query vectors (queries[m]: dim floats; positions[m]: the position of its
// token) over keys 0 .. max(positions) gathered by gather_keys; out[m]: dim floats.
template <int M>
void attend_tile(const float* const* queries, const int64_t* positions, int64_t dim,
                 const float* transposed, const float* values, float scale, float* const* out) {
    int64_t last = 0;
    for (int m = 0; m < M; ++m) last = std::max(last, positions[m]);
    thread_local std::vector<float> partial;  // [M][dim]: each query's weighted values so far
    if (static_cast<int64_t>(partial.size()) < M * dim) partial.resize(M * dim);
    float* o = partial.data();
    std::fill(o, o + M * dim, 0.0f);
    float top[M];
    __m512 total[M];  // lane-wise sums of the weights (added across lanes at the end)
    for (int m = 0; m < M; ++m) top[m] = -INFINITY, total[m] = _mm512_setzero_ps();
    alignas(64) float weights[M][kKeyBlock];
    for (int64_t k0 = 0; k0 <= last; k0 += kKeyBlock) {
        const float* kt = transposed + (k0 / kKeyBlock) * dim * kKeyBlock;
        __m512 s[M];
        for (int m = 0; m < M; ++m) s[m] = _mm512_setzero_ps();
        for (int64_t e = 0; e < dim; ++e) {
            const __m512 key = _mm512_load_ps(kt + e * kKeyBlock);
            for (int m = 0; m < M; ++m)
                s[m] = _mm512_fmadd_ps(_mm512_set1_ps(queries[m][e]), key, s[m]);
        }
        float factor[M];
        for (int m = 0; m < M; ++m) {
            // keys at or before the query's position count; a block wholly after it changes
            // nothing (no weights, factor 1)
            const __mmask16 seen = tail_mask(positions[m] + 1 - k0);
            factor[m] = 1.0f;
            if (seen == 0) {
                _mm512_store_ps(weights[m], _mm512_setzero_ps());
                continue;
            }
            const __m512 scores = _mm512_mul_ps(s[m], _mm512_set1_ps(scale));
            const float block_top = _mm512_mask_reduce_max_ps(seen, scores);
            const float new_top = std::max(top[m], block_top);
            if (new_top > top[m]) {
                factor[m] = top[m] == -INFINITY ? 0.0f : std::exp(top[m] - new_top);
                top[m] = new_top;
            }
            const __m512 e =
                _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(new_top))));
            total[m] = _mm512_fmadd_ps(total[m], _mm512_set1_ps(factor[m]), e);
            _mm512_store_ps(weights[m], e);
        }
        const int64_t keys = std::min<int64_t>(kKeyBlock, last + 1 - k0);
        for (int64_t c = 0; c < dim; c += 16) {
            __m512 acc[M];
            for (int m = 0; m < M; ++m)
                acc[m] = _mm512_mul_ps(_mm512_loadu_ps(o + m * dim + c), _mm512_set1_ps(factor[m]));
            for (int64_t i = 0; i < keys; ++i) {
                const __m512 v = _mm512_loadu_ps(values + (k0 + i) * dim + c);
                for (int m = 0; m < M; ++m)
                    acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(weights[m][i]), v, acc[m]);
            }
            for (int m = 0; m < M; ++m) _mm512_storeu_ps(o + m * dim + c, acc[m]);
        }
    }
    for (int m = 0; m < M; ++m) {
        const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total[m]));
        for (int64_t c = 0; c < dim; c += 16)
            _mm512_storeu_ps(out[m] + c, _mm512_mul_ps(_mm512_loadu_ps(o + m * dim + c), inverse));
    }
}

// Tokens a tile for G query heads a KV head: up to 16 query vectors.
template <int G>
constexpr int kTileTokens = G >= 16 ? 1 : 16 / G;

// Tokens first .. end - 1 of one sequence (consecutive positions, one table), one KV head h:
// its keys gathered once, then tiles of kTileTokens<G> tokens (the last one padded with
// copies of the run's last token, whose results are dropped).
template <int G, typename T>
void attend_run(const float* qkv, int64_t width, int64_t first, int64_t end, int64_t h,
                int64_t heads, int64_t kv_heads, int64_t dim, const T* pool,
                const int64_t* table, int64_t block_size, const int64_t* positions, float scale,
                float* out) {
    constexpr int Q = kTileTokens<G>, M = Q * G;
    const int64_t slot_width = 2 * kv_heads * dim, count = positions[end - 1] + 1;
    thread_local std::vector<float> keys, values, dropped;
    const int64_t blocks = (count + kKeyBlock - 1) / kKeyBlock;
    if (static_cast<int64_t>(keys.size()) < blocks * dim * kKeyBlock + 16)
        keys.resize(blocks * dim * kKeyBlock + 16);
    if (static_cast<int64_t>(values.size()) < count * dim) values.resize(count * dim);
    if (static_cast<int64_t>(dropped.size()) < M * dim) dropped.resize(M * dim);
    // 64-byte aligned: the tile loads a block's key rows with aligned loads
    float* transposed = keys.data() + (16 - reinterpret_cast<uintptr_t>(keys.data()) / 4 % 16) % 16;
    gather_keys(pool, slot_width, h * dim, kv_heads * dim, table, block_size, count, dim,
                transposed, values.data());
    for (int64_t t0 = first; t0 < end; t0 += Q) {
        const float* queries[M];
        float* results[M];
        int64_t where[M];
        for (int q = 0; q < Q; ++q) {
            const int64_t t = std::min(t0 + q, end - 1);
            for (int g = 0; g < G; ++g) {
                const int64_t head = h * G + g;
                queries[q * G + g] = qkv + t * width + head * dim;
                results[q * G + g] = t0 + q < end ? out + t * heads * dim + head * dim
                                                  : dropped.data() + (q * G + g) * dim;
                where[q * G + g] = positions[t];
            }
        }
        attend_tile<M>(queries, where, dim, transposed, values.data(), scale, results);
    }
}

template <typename T>
void attend_prompt(const float* qkv, int64_t rows, const uint8_t* tiled, int64_t heads,
                   int64_t kv_heads, int64_t dim, const T* pool, const int64_t* blocks, int64_t blocks_per_row,
                   int64_t block_size, const int64_t* positions, float scale, float* out,
                   int threads) {
    const int64_t width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
    // Runs: a sequence's tokens (consecutive positions under one table), split in parts of
    // about equal work (a token's keys) so that every thread has some.
    struct Run {
        int64_t first, end;
    };
    std::vector<Run> runs;
    std::vector<int64_t> alone;  // tokens not tiled
    for (int64_t t = 0; t < rows;) {
        if (!tiled[t]) {
            alone.push_back(t++);
            continue;
        }
        int64_t end = t + 1;
        while (end < rows && tiled[end] && positions[end] == positions[end - 1] + 1 &&
               std::equal(blocks + end * blocks_per_row, blocks + (end + 1) * blocks_per_row,
                          blocks + t * blocks_per_row))
            ++end;
        runs.push_back({t, end});
        t = end;
    }
    const int64_t parts = std::max<int64_t>(1, (2 * threads + kv_heads - 1) / kv_heads);
    std::vector<Run> pieces;
    for (const Run& run : runs) {
        double work = 0;
        for (int64_t t = run.first; t < run.end; ++t) work += positions[t] + 1;
        double done = 0;
        int64_t start = run.first, made = 0;
        for (int64_t t = run.first; t < run.end; ++t) {
            done += positions[t] + 1;
            if (done >= work * static_cast<double>(made + 1) / parts || t + 1 == run.end) {
                pieces.push_back({start, t + 1});
                start = t + 1;
                ++made;
            }
        }
    }
    const int64_t tasks = static_cast<int64_t>(pieces.size()) * kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t task = 0; task < tasks; ++task) {
        const Run& piece = pieces[task / kv_heads];
        const int64_t h = task % kv_heads;
        const int64_t* table = blocks + piece.first * blocks_per_row;
        switch (group) {
#define MH_GROUP(G)                                                                           \
    case G:                                                                                   \
        attend_run<G>(qkv, width, piece.first, piece.end, h, heads, kv_heads, dim, pool, table, \
                      block_size, positions, scale, out);                                     \
        break;
            MH_GROUP(1) MH_GROUP(2) MH_GROUP(3) MH_GROUP(4) MH_GROUP(5) MH_GROUP(6) MH_GROUP(7)
            MH_GROUP(8) MH_GROUP(16)
#undef MH_GROUP
            default: break;
        }
    }
    // The others as mh_paged_attention attends them (the same result as in any other step).
    const int64_t slot_width = 2 * kv_heads * dim;
    const int64_t singles = static_cast<int64_t>(alone.size()) * kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && singles > 1)
    for (int64_t task = 0; task < singles; ++task) {
        const int64_t r = alone[task / kv_heads], h = task % kv_heads;
        attend(qkv + r * width + h * group * dim, group, dim, pool, slot_width, h * dim,
               kv_heads * dim, blocks + r * blocks_per_row, block_size, 0, positions[r] + 1,
               scale, 0.0f, out + r * heads * dim + h * group * dim);
    }
}

}  // namespace

// Whether mh_prompt_attention takes a model with `group` query heads a KV head.
extern "C" int mh_prompt_attention_groups(int64_t group) {
    return (group >= 1 && group <= 8) || group == 16;
}

// A prompt step's causal attention (no window, no soft-cap): qkv, the pool and the tables as
// mh_paged_attention's (q/k norms, rotary and the keys' store included); out [rows, heads *
// dim]. The tokens marked in `tiled` [rows] (a prompt's rows at 8 bits) are tiled as above;
// the others (a prompt's last token, decode and verification rows) attend as
// mh_paged_attention's do, so that their results never depend on the step they share.
extern "C" void mh_prompt_attention(float* qkv, int64_t rows, int64_t heads, int64_t kv_heads,
                                    int64_t dim, const float* qk_norm_weight, float eps,
                                    const float* cos, const float* sin, void* pool, int half,
                                    const int64_t* slots, const int64_t* blocks,
                                    int64_t blocks_per_row, int64_t block_size,
                                    const int64_t* positions, const uint8_t* tiled,
                                    float scale, float* out, int threads) {
    store_keys(qkv, rows, heads, kv_heads, dim, qk_norm_weight, eps, cos, sin, pool, half, slots,
               threads);
    if (half)
        attend_prompt(qkv, rows, tiled, heads, kv_heads, dim, static_cast<const uint16_t*>(pool), blocks,
                      blocks_per_row, block_size, positions, scale, out, threads);
    else
        attend_prompt(qkv, rows, tiled, heads, kv_heads, dim, static_cast<const float*>(pool), blocks,
                      blocks_per_row, block_size, positions, scale, out, threads);
}
