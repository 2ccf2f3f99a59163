// A prompt step's attention, tiled: the queries of several consecutive tokens of one sequence
// (and the query heads that share a KV head) against each block of 16 keys together, where
// mh_paged_attention takes one token's heads at a time. Each key and value is read (and
// converted from fp16) once for a tile of up to 16 query vectors instead of once per token,
// and no work is done above the causal diagonal. Softmax online (a running maximum and sum a
// query, FlashAttention's): a query's result depends only on its own keys, taken in order of
// position 16 at a time, whatever tile it shares and whatever the thread count is.
//
// Long contexts: a run's keys are laid out for the tiles once per step and KV head (not once
// per thread's piece), in the pool's own type, and a piece's tiles take them a span of
// kSpanKeys at a time, every tile before the next span, so the span's keys and values are
// read from the core's cache rather than from memory once per tile.
//
// Sliding-window layers (Gemma 2/3, Mistral) lay out and score only the blocks of 16 that
// hold a tile's window, so a prompt's token costs its window, not the context; soft-capped
// scores (Gemma 2) are squashed in the tile as mh_paged_attention's are. Blocks of keys are
// aligned at multiples of 16 positions whatever the chunk and the tile: a token's result does
// not depend on how its prompt was chunked.
//
// Included by native_kernels.cpp after store_keys (the norm, rotary and store it shares with
// mh_paged_attention).

#pragma once

#include "native_common.h"

namespace {

constexpr int64_t kKeyBlock = 16;  // keys scored together: one register of scores a query
// A token's mark in mh_prompt_attention's `tiled`: 0 attends alone (as mh_paged_attention's).
constexpr uint8_t kTiled = 1, kAttendedByCaller = 2;
// Keys a span (a multiple of kKeyBlock): Gemma 3's 256-wide fp16 heads put a span's keys and
// values in 512 KB of a core's 2 MB cache.
constexpr int64_t kSpanKeys = 512;

// The first key position a token at `position` sees: window > 0 keeps the last `window`.
inline int64_t first_seen(int64_t position, int64_t window) {
    return window > 0 && position >= window ? position - window + 1 : 0;
}

// Where a position's key sits in the pool (one KV head's: `key_offset` into the slot).
template <typename T>
inline const T* key_at(const T* pool, int64_t slot_width, int64_t key_offset,
                       const int64_t* table, int64_t block_size, int64_t p) {
    return pool + (table[p / block_size] * block_size + p % block_size) * slot_width + key_offset;
}

// Keys of positions block * 16 .. + 15 (below count; zeros after it) copied into
// `transposed` [dim][16] (lane i: the block's key i), in the pool's type.
template <typename T>
void lay_out_block(const T* pool, int64_t slot_width, int64_t key_offset, const int64_t* table,
                   int64_t block_size, int64_t block, int64_t count, int64_t dim, T* transposed) {
    std::fill(transposed, transposed + dim * kKeyBlock, T(0));
    for (int64_t i = 0; i < kKeyBlock && block * kKeyBlock + i < count; ++i) {
        const T* key = key_at(pool, slot_width, key_offset, table, block_size, block * kKeyBlock + i);
        for (int64_t e = 0; e < dim; ++e) transposed[e * kKeyBlock + i] = key[e];
    }
}

// softcap * tanh(x / softcap) in each lane, as (1 - e^-2y) / (1 + e^-2y) of y = x / softcap
// (held within +-10, where tanh is 1 to fp32's precision).
inline __m512 softcapped(__m512 x, float softcap) {
    const __m512 limit = _mm512_set1_ps(-10.0f), zero = _mm512_setzero_ps();
    __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.0f / softcap)), limit);
    y = _mm512_sub_ps(zero, _mm512_max_ps(_mm512_sub_ps(zero, y), limit));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 t = exp16(_mm512_mul_ps(y, _mm512_set1_ps(-2.0f)));
    return _mm512_mul_ps(_mm512_div_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t)),
                         _mm512_set1_ps(softcap));
}

// One tile's M query vectors and their online softmax so far.
template <int M>
struct Tile {
    const float* queries[M];  // dim floats each
    float* out[M];
    int64_t positions[M], seen_from[M];
    int64_t start, last;  // the first block's first position, the last key any query sees
    float top[M];         // each query's largest score so far
    float total[M][16];   // lane-wise sums of its weights (added across lanes at the end)
    float* partial;       // [M][dim]: its weighted values so far
    float* lanes;         // [dim][M]: the queries side by side, element by element
};

template <int M>
void open_tile(Tile<M>& tile, int64_t window, int64_t dim) {
    tile.last = 0;
    tile.start = INT64_MAX;
    for (int m = 0; m < M; ++m) {
        tile.last = std::max(tile.last, tile.positions[m]);
        tile.seen_from[m] = first_seen(tile.positions[m], window);
        tile.start = std::min(tile.start, tile.seen_from[m]);
        tile.top[m] = -INFINITY;
        _mm512_storeu_ps(tile.total[m], _mm512_setzero_ps());
    }
    tile.start = tile.start / kKeyBlock * kKeyBlock;
    std::fill(tile.partial, tile.partial + M * dim, 0.0f);
    // One base address for the scores' broadcasts: M pointers were more than the registers
    // hold, and each product then loaded its query's address before its element.
    for (int64_t e = 0; e < dim; ++e)
        for (int m = 0; m < M; ++m) tile.lanes[e * M + m] = tile.queries[m][e];
}

// The tile's queries against the blocks of keys from `begin` up to `end` (positions, multiples
// of 16) that it sees. Keys: laid out by lay_out_block from position `from` on; values read
// in the pool (`value_offset` into a slot).
template <int M, typename T>
void attend_blocks(Tile<M>& tile, int64_t dim, int64_t from, const T* transposed,
                   const T* pool, int64_t slot_width, int64_t value_offset,
                   const int64_t* table, int64_t block_size, int64_t begin, int64_t end,
                   float scale, float softcap) {
    alignas(64) float weights[M][kKeyBlock];
    float* o = tile.partial;
    for (int64_t k0 = std::max(begin, tile.start); k0 < end && k0 <= tile.last; k0 += kKeyBlock) {
        const T* kt = transposed + ((k0 - from) / kKeyBlock) * dim * kKeyBlock;
        __m512 s[M];
        for (int m = 0; m < M; ++m) s[m] = _mm512_setzero_ps();
        const float* lanes = tile.lanes;
        for (int64_t e = 0; e < dim; ++e, lanes += M) {
            const __m512 key = load_cached(kt + e * kKeyBlock);
            for (int m = 0; m < M; ++m)
                s[m] = _mm512_fmadd_ps(_mm512_set1_ps(lanes[m]), key, s[m]);
        }
        float factor[M];
        for (int m = 0; m < M; ++m) {
            // keys at or before the query's position (and within its window) count; a block
            // wholly outside them changes nothing (no weights, factor 1)
            const __mmask16 seen = static_cast<__mmask16>(
                tail_mask(tile.positions[m] + 1 - k0) & ~tail_mask(tile.seen_from[m] - k0));
            factor[m] = 1.0f;
            if (seen == 0) {
                _mm512_store_ps(weights[m], _mm512_setzero_ps());
                continue;
            }
            __m512 scores = _mm512_mul_ps(s[m], _mm512_set1_ps(scale));
            if (softcap > 0.0f) scores = softcapped(scores, softcap);
            const float block_top = _mm512_mask_reduce_max_ps(seen, scores);
            const float new_top = std::max(tile.top[m], block_top);
            if (new_top > tile.top[m]) {
                factor[m] = tile.top[m] == -INFINITY ? 0.0f : std::exp(tile.top[m] - new_top);
                tile.top[m] = new_top;
            }
            const __m512 e =
                _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(new_top))));
            _mm512_storeu_ps(tile.total[m], _mm512_fmadd_ps(_mm512_loadu_ps(tile.total[m]),
                                                            _mm512_set1_ps(factor[m]), e));
            _mm512_store_ps(weights[m], e);
        }
        const int64_t keys = std::min<int64_t>(kKeyBlock, tile.last + 1 - k0);
        const T* values[kKeyBlock];
        for (int64_t i = 0; i < keys; ++i)
            values[i] = key_at(pool, slot_width, value_offset, table, block_size, k0 + i);
        for (int64_t c = 0; c < dim; c += 16) {
            __m512 acc[M];
            for (int m = 0; m < M; ++m)
                acc[m] = _mm512_mul_ps(_mm512_loadu_ps(o + m * dim + c), _mm512_set1_ps(factor[m]));
            for (int64_t i = 0; i < keys; ++i) {
                const __m512 v = load_cached(values[i] + c);
                for (int m = 0; m < M; ++m)
                    acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(weights[m][i]), v, acc[m]);
            }
            for (int m = 0; m < M; ++m) _mm512_storeu_ps(o + m * dim + c, acc[m]);
        }
    }
}

template <int M>
void close_tile(const Tile<M>& tile, int64_t dim) {
    for (int m = 0; m < M; ++m) {
        const __m512 inverse =
            _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(tile.total[m])));
        for (int64_t c = 0; c < dim; c += 16)
            _mm512_storeu_ps(tile.out[m] + c,
                             _mm512_mul_ps(_mm512_loadu_ps(tile.partial + m * dim + c), inverse));
    }
}

// Tokens a tile for G query heads a KV head: up to 16 query vectors.
template <int G>
constexpr int kTileTokens = G >= 16 ? 1 : 16 / G;

// Tokens first .. end - 1 of one sequence (consecutive positions, one table), one KV head h,
// whose keys from position `from` on lay in `transposed`: tiles of kTileTokens<G> tokens (the
// last one padded with copies of the piece's last token, whose results are dropped), all of
// them against one span of keys before the next.
template <int G, typename T>
void attend_piece(const float* qkv, int64_t width, int64_t first, int64_t end, int64_t h,
                  int64_t heads, int64_t kv_heads, int64_t dim, const T* pool,
                  const int64_t* table, int64_t block_size, const int64_t* positions,
                  int64_t from, const T* transposed, int64_t window, float scale,
                  float softcap, float* out) {
    constexpr int Q = kTileTokens<G>, M = Q * G;
    const int64_t slot_width = 2 * kv_heads * dim;
    const int64_t count = (end - first + Q - 1) / Q;
    thread_local std::vector<Tile<M>> tiles;
    thread_local std::vector<float> partial, dropped;
    if (static_cast<int64_t>(tiles.size()) < count) tiles.resize(count);
    if (static_cast<int64_t>(partial.size()) < 2 * count * M * dim)
        partial.resize(2 * count * M * dim);  // each tile's partial sums, then its lanes
    if (static_cast<int64_t>(dropped.size()) < M * dim) dropped.resize(M * dim);
    int64_t begin = INT64_MAX, last = 0;
    for (int64_t j = 0; j < count; ++j) {
        Tile<M>& tile = tiles[j];
        const int64_t t0 = first + j * Q;
        for (int q = 0; q < Q; ++q) {
            const int64_t t = std::min(t0 + q, end - 1);
            for (int g = 0; g < G; ++g) {
                const int64_t head = h * G + g;
                tile.queries[q * G + g] = qkv + t * width + head * dim;
                tile.out[q * G + g] = t0 + q < end ? out + t * heads * dim + head * dim
                                                   : dropped.data() + (q * G + g) * dim;
                tile.positions[q * G + g] = positions[t];
            }
        }
        tile.partial = partial.data() + j * M * dim;
        tile.lanes = partial.data() + (count + j) * M * dim;
        open_tile(tile, window, dim);
        begin = std::min(begin, tile.start);
        last = std::max(last, tile.last);
    }
    for (int64_t span = begin; span <= last; span += kSpanKeys)
        for (int64_t j = 0; j < count; ++j)
            attend_blocks(tiles[j], dim, from, transposed, pool, slot_width, h * dim + kv_heads * dim,
                          table, block_size, span, span + kSpanKeys, scale, softcap);
    for (int64_t j = 0; j < count; ++j) close_tile(tiles[j], dim);
}

template <typename T>
void attend_prompt(const float* qkv, int64_t rows, const uint8_t* tiled, int64_t heads,
                   int64_t kv_heads, int64_t dim, const T* pool, const int64_t* blocks,
                   int64_t blocks_per_row, int64_t block_size, const int64_t* positions,
                   int64_t window, float scale, float softcap, float* out, int threads) {
    const int64_t width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
    const int64_t slot_width = 2 * kv_heads * dim;
    // Runs: a sequence's tokens (consecutive positions under one table), each with the keys
    // its tokens see (from `from`, a multiple of 16, to `count`) and where they are laid out.
    struct Run {
        int64_t first, end, from, count, laid;  // laid: offset of KV head 0's keys in `keys`
    };
    std::vector<Run> runs;
    std::vector<int64_t> alone;  // tokens not tiled
    int64_t laid = 0;
    for (int64_t t = 0; t < rows;) {
        if (tiled[t] == kAttendedByCaller) {
            ++t;
            continue;
        }
        if (tiled[t] != kTiled) {
            alone.push_back(t++);
            continue;
        }
        int64_t end = t + 1;
        while (end < rows && tiled[end] == kTiled && positions[end] == positions[end - 1] + 1 &&
               std::equal(blocks + end * blocks_per_row, blocks + (end + 1) * blocks_per_row,
                          blocks + t * blocks_per_row))
            ++end;
        const int64_t from = first_seen(positions[t], window) / kKeyBlock * kKeyBlock;
        const int64_t count = positions[end - 1] + 1;
        runs.push_back({t, end, from, count, laid});
        laid += kv_heads * ((count - from + kKeyBlock - 1) / kKeyBlock) * dim * kKeyBlock;
        t = end;
    }
    thread_local std::vector<T> keys;  // this (calling) thread's: the workers see `laid_keys`
    if (static_cast<int64_t>(keys.size()) < laid) keys.resize(laid);
    T* const laid_keys = keys.data();
    // Every run's keys laid out once, a block of 16 keys of one KV head a task.
    struct Block {
        int64_t run, h, block;
    };
    std::vector<Block> layout;
    for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r)
        for (int64_t h = 0; h < kv_heads; ++h)
            for (int64_t b = runs[r].from / kKeyBlock; b * kKeyBlock < runs[r].count; ++b)
                layout.push_back({r, h, b});
    const int64_t laid_blocks = static_cast<int64_t>(layout.size());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && laid_blocks > 64)
    for (int64_t i = 0; i < laid_blocks; ++i) {
        const Run& run = runs[layout[i].run];
        const int64_t h = layout[i].h, b = layout[i].block;
        const int64_t per_head = ((run.count - run.from + kKeyBlock - 1) / kKeyBlock) * dim * kKeyBlock;
        T* transposed = laid_keys + run.laid + h * per_head + (b - run.from / kKeyBlock) * dim * kKeyBlock;
        lay_out_block(pool, slot_width, h * dim, blocks + run.first * blocks_per_row, block_size,
                      b, run.count, dim, transposed);
    }
    // Pieces: runs split in parts of about equal work (the keys a token sees) so that every
    // thread has some.
    struct Piece {
        int64_t run, first, end;
    };
    const int64_t parts = std::max<int64_t>(1, (2 * threads + kv_heads - 1) / kv_heads);
    std::vector<Piece> pieces;
    for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r) {
        const Run& run = runs[r];
        const auto seen = [&](int64_t t) {
            return static_cast<double>(positions[t] + 1 - first_seen(positions[t], window));
        };
        double work = 0;
        for (int64_t t = run.first; t < run.end; ++t) work += seen(t);
        double done = 0;
        int64_t start = run.first, made = 0;
        for (int64_t t = run.first; t < run.end; ++t) {
            done += seen(t);
            if (done >= work * static_cast<double>(made + 1) / parts || t + 1 == run.end) {
                pieces.push_back({r, start, t + 1});
                start = t + 1;
                ++made;
            }
        }
    }
    const int64_t tasks = static_cast<int64_t>(pieces.size()) * kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t task = 0; task < tasks; ++task) {
        const Piece& piece = pieces[task / kv_heads];
        const Run& run = runs[piece.run];
        const int64_t h = task % kv_heads;
        const int64_t* table = blocks + piece.first * blocks_per_row;
        const int64_t per_head = ((run.count - run.from + kKeyBlock - 1) / kKeyBlock) * dim * kKeyBlock;
        const T* transposed = laid_keys + run.laid + h * per_head;
        switch (group) {
#define MH_GROUP(G)                                                                            \
    case G:                                                                                    \
        attend_piece<G>(qkv, width, piece.first, piece.end, h, heads, kv_heads, dim, pool,    \
                        table, block_size, positions, run.from, transposed, window, scale,    \
                        softcap, out);                                                         \
        break;
            MH_GROUP(1) MH_GROUP(2) MH_GROUP(3) MH_GROUP(4) MH_GROUP(5) MH_GROUP(6) MH_GROUP(7)
            MH_GROUP(8) MH_GROUP(16)
#undef MH_GROUP
            default: break;
        }
    }
    // The others as mh_paged_attention attends them (the same result as in any other step).
    const int64_t singles = static_cast<int64_t>(alone.size()) * kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && singles > 1)
    for (int64_t task = 0; task < singles; ++task) {
        const int64_t r = alone[task / kv_heads], h = task % kv_heads;
        const int64_t first = first_seen(positions[r], window);
        attend(qkv + r * width + h * group * dim, group, dim, pool, slot_width, h * dim,
               kv_heads * dim, blocks + r * blocks_per_row, block_size, first,
               positions[r] + 1 - first, scale, softcap, out + r * heads * dim + h * group * dim);
    }
}

}  // namespace

// Whether mh_prompt_attention takes a model with `group` query heads a KV head.
extern "C" int mh_prompt_attention_groups(int64_t group) {
    return (group >= 1 && group <= 8) || group == 16;
}

// A prompt step's causal attention (within `window` where window > 0, scores soft-capped
// where softcap > 0): qkv, the pool and the tables as mh_paged_attention's (q/k norms, rotary
// and the keys' store included); out [rows, heads * dim]. The tokens marked 1 in `tiled` [rows]
// (a prompt's tokens before its last) are tiled as above; those marked 2 are left to the caller
// (their queries normed and rotated in qkv, their keys stored; their rows of out untouched); the
// others (a prompt's last token, decode and verification rows) attend as mh_paged_attention's
// do, so that their results never depend on the step they share.
extern "C" void mh_prompt_attention(float* qkv, int64_t rows, int64_t heads, int64_t kv_heads,
                                    int64_t dim, const float* qk_norm_weight, float eps,
                                    const float* cos, const float* sin, void* pool, int half,
                                    const int64_t* slots, const int64_t* blocks,
                                    int64_t blocks_per_row, int64_t block_size,
                                    const int64_t* positions, const uint8_t* tiled,
                                    int64_t window, float scale, float softcap, float* out,
                                    int threads) {
    store_keys(qkv, rows, heads, kv_heads, dim, qk_norm_weight, eps, cos, sin, pool, half, slots,
               threads);
    if (half)
        attend_prompt(qkv, rows, tiled, heads, kv_heads, dim, static_cast<const uint16_t*>(pool),
                      blocks, blocks_per_row, block_size, positions, window, scale, softcap, out,
                      threads);
    else
        attend_prompt(qkv, rows, tiled, heads, kv_heads, dim, static_cast<const float*>(pool),
                      blocks, blocks_per_row, block_size, positions, window, scale, softcap, out,
                      threads);
}
