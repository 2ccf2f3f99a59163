// LoRA updates inside a decode step (mh_decode_layers): after a host linear's base output, each
// row adds scale * (x @ A^T) @ B^T of its own adapter. A step's adapters are stacked a host
// module at a time (models/adapters/row_adapters.py): one A of every adapter's rank rows, each
// target's B (the host's output columns it patches) over its rank columns, both in bf16 (half
// the bytes of fp32, which a memory-bound step reads every time; fp32's range, so no weight
// overflows), and a mask of each row's scale on its own adapter's rank columns, 0 elsewhere.
// Products are summed in fp32. Only a row's nonzero columns are computed: a row of the bare
// base gets nothing added (its output is the base's, bit for bit), and a row's result does not
// depend on the other rows or on the thread count.

#pragma once

#include "native_common.h"

struct NativeLoraTarget {
    int64_t start, stop;   // the host's output columns it patches
    int64_t first, ranks;  // its rank columns of the stack: first .. first + ranks - 1
    const uint16_t* b;     // bf16 [ranks, stop - start]: B transposed
};

struct NativeLora {
    const uint16_t* a;                 // bf16 [ranks, in], or null: the host is not patched
    const float* mask;                 // [rows, ranks]
    const NativeLoraTarget* targets;   // [count]
    int64_t count, ranks, in;
};

namespace {

thread_local std::vector<float> lora_buffer;

// Up to 16 bf16 values (count of them, the lanes past them 0) as fp32, reading no further.
inline __m512 load_bf16(const uint16_t* p, int64_t count) {
    __m256i bits;
    if (count >= 16) {
        bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    } else {
        alignas(32) uint16_t tail[16] = {};
        std::memcpy(tail, p, sizeof(uint16_t) * count);
        bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
    }
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// low[r, k] = mask[r, k] * (x[r] . a[k]) for the rows whose mask there is nonzero, 0 for the
// others; up to kTile rows share each read of a[k]. x [rows, in].
void lora_down(const NativeLora& l, const float* x, int64_t rows, float* low, int threads) {
    const int64_t in = l.in, ranks = l.ranks;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t k = 0; k < ranks; ++k) {
        const uint16_t* a = l.a + k * in;
        int64_t picked[kTile];
        int n = 0;
        auto flush = [&]() {
            __m512 acc[kTile];
            for (int j = 0; j < n; ++j) acc[j] = _mm512_setzero_ps();
            for (int64_t i = 0; i < in; i += 16) {
                const __mmask16 live = tail_mask(in - i);
                const __m512 w = load_bf16(a + i, in - i);
                for (int j = 0; j < n; ++j)
                    acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, x + picked[j] * in + i), w,
                                             acc[j]);
            }
            for (int j = 0; j < n; ++j)
                low[picked[j] * ranks + k] =
                    _mm512_reduce_add_ps(acc[j]) * l.mask[picked[j] * ranks + k];
            n = 0;
        };
        for (int64_t r = 0; r < rows; ++r) {
            low[r * ranks + k] = 0.0f;
            if (l.mask[r * ranks + k] == 0.0f) continue;
            picked[n++] = r;
            if (n == kTile) flush();
        }
        if (n > 0) flush();
    }
}

// y[r, start + c] += sum over k of low[r, first + k] * b[k, c], for each target, over its
// nonzero rank columns; the columns split among threads. y [rows, width].
void lora_up(const NativeLora& l, const float* low, int64_t rows, float* y, int64_t width,
             int threads) {
    for (int64_t t = 0; t < l.count; ++t) {
        const NativeLoraTarget& target = l.targets[t];
        const int64_t columns = target.stop - target.start;
        const int64_t share = (columns + 8 * threads - 1) / (8 * threads);
        const int64_t chunk = std::max<int64_t>(64, (share + 15) / 16 * 16);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
        for (int64_t begin = 0; begin < columns; begin += chunk) {
            const int64_t end = std::min(begin + chunk, columns);
            int64_t used[256];  // a row's nonzero rank columns of this target
            for (int64_t r = 0; r < rows; ++r) {
                const float* mine = low + r * l.ranks + target.first;
                for (int64_t k0 = 0; k0 < target.ranks; k0 += 256) {
                    int64_t n = 0;
                    for (int64_t k = k0; k < std::min(k0 + 256, target.ranks); ++k)
                        if (mine[k] != 0.0f) used[n++] = k;
                    if (n == 0) continue;
                    float* out = y + r * width + target.start;
                    for (int64_t c = begin; c < end; c += 16) {
                        const __mmask16 live = tail_mask(end - c);
                        __m512 acc = _mm512_maskz_loadu_ps(live, out + c);
                        for (int64_t j = 0; j < n; ++j)
                            acc = _mm512_fmadd_ps(_mm512_set1_ps(mine[used[j]]),
                                                  load_bf16(target.b + used[j] * columns + c,
                                                            end - c),
                                                  acc);
                        _mm512_mask_storeu_ps(out + c, live, acc);
                    }
                }
            }
        }
    }
}

// y [rows, width] += each row's update of host `l` for x [rows, l.in]; nothing for a host no
// adapter of the step patches.
void add_lora(const NativeLora& l, const float* x, int64_t rows, float* y, int64_t width,
              int threads) {
    if (l.a == nullptr) return;
    if (static_cast<int64_t>(lora_buffer.size()) < rows * l.ranks)
        lora_buffer.resize(rows * l.ranks);
    lora_down(l, x, rows, lora_buffer.data(), threads);
    lora_up(l, lora_buffer.data(), rows, y, width, threads);
}

}  // namespace
