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
// others; up to kTile rows share each read of a[k]. x [rows, in]. (In a parallel region.)
void lora_down(const NativeLora& l, const float* x, int64_t rows, float* low) {
    const int64_t in = l.in, ranks = l.ranks;
#pragma omp for schedule(dynamic, 1)
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

// y[r, start + c] += sum over k of low[r, first + k] * b[k, c] for columns begin .. end - 1 of
// `target`, over each row's nonzero rank columns. y [rows, width].
void lora_up(const NativeLoraTarget& target, const float* low, int64_t ranks, int64_t rows,
             float* y, int64_t width, int64_t begin, int64_t end) {
    const int64_t columns = target.stop - target.start;
    int64_t used[256];  // a row's nonzero rank columns of this target, 256 at a time
    for (int64_t r = 0; r < rows; ++r) {
        const float* mine = low + r * ranks + target.first;
        float* out = y + r * width + target.start;
        for (int64_t k0 = 0; k0 < target.ranks; k0 += 256) {
            int64_t n = 0;
            for (int64_t k = k0; k < std::min(k0 + 256, target.ranks); ++k)
                if (mine[k] != 0.0f) used[n++] = k;
            for (int64_t c = begin; n > 0 && c < end; c += 16) {
                const __mmask16 live = tail_mask(end - c);
                __m512 acc = _mm512_maskz_loadu_ps(live, out + c);
                for (int64_t j = 0; j < n; ++j)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(mine[used[j]]),
                                          load_bf16(target.b + used[j] * columns + c, end - c), acc);
                _mm512_mask_storeu_ps(out + c, live, acc);
            }
        }
    }
}

constexpr int64_t kLoraColumns = 128;  // a target's output columns a task

// y [rows, width] += each row's update of host `l` for x [rows, l.in]; nothing for a host no
// adapter of the step patches. One parallel region (a region's end waits for every thread,
// and on a shared machine for a preempted one): rank columns split among the threads, then
// every target's output columns.
void add_lora(const NativeLora& l, const float* x, int64_t rows, float* y, int64_t width,
              int threads) {
    if (l.a == nullptr) return;
    if (static_cast<int64_t>(lora_buffer.size()) < rows * l.ranks)
        lora_buffer.resize(rows * l.ranks);
    float* low = lora_buffer.data();
    int64_t tasks = 0;
    for (int64_t t = 0; t < l.count; ++t)
        tasks += (l.targets[t].stop - l.targets[t].start + kLoraColumns - 1) / kLoraColumns;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        lora_down(l, x, rows, low);  // (its loop ends with every thread's part done)
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            int64_t t = 0, chunk = task;
            for (;; ++t) {
                const int64_t columns = l.targets[t].stop - l.targets[t].start;
                const int64_t chunks = (columns + kLoraColumns - 1) / kLoraColumns;
                if (chunk < chunks) break;
                chunk -= chunks;
            }
            const int64_t columns = l.targets[t].stop - l.targets[t].start;
            const int64_t begin = chunk * kLoraColumns;
            lora_up(l.targets[t], low, l.ranks, rows, y, width, begin,
                    std::min(begin + kLoraColumns, columns));
        }
    }
}

}  // namespace
