// A mixture-of-experts MLP's experts for a step (models/networks/moe.py), included at the end of
// native_kernels.cpp: the step's rows grouped by the experts they chose, each chosen expert's
// packed weights read once for all its rows, and each row's weighted outputs summed over its
// experts in expert order (a row's result does not depend on the other rows).

#pragma once

#include "native_common.h"
#include "native_qlinear.h"

namespace {

struct ExpertRow {
    int64_t expert, row;
    float weight;
};

thread_local std::vector<float> moe_buffer;

// `n` floats of `buffer` from a 64-byte boundary on (the kernels load whole cache lines).
float* aligned_floats(std::vector<float>& buffer, int64_t n) {
    if (static_cast<int64_t>(buffer.size()) < n + 16) buffer.resize(n + 16);
    return buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / 4 % 16) % 16;
}

}  // namespace

// out [rows, width] = sum over k of weights[r, k] * expert ids[r, k] (x[r]), where an expert
// is down(act(gate(x)) * up(x)): gate_up[e] holds its gate and up outputs side by side
// (out 2 ff), down[e] its down projection (out `width`). x [rows, width] fp32.
extern "C" void mh_moe_experts(const float* x, int64_t rows, int64_t width, const int64_t* ids,
                               const float* weights, int64_t k, const QLinear* gate_up,
                               const QLinear* down, int act, float* out, int threads) {
    const int64_t count = rows * k;
    std::vector<ExpertRow> chosen;
    chosen.reserve(count);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < k; ++j) chosen.push_back({ids[r * k + j], r, weights[r * k + j]});
    std::stable_sort(chosen.begin(), chosen.end(),
                     [](const ExpertRow& a, const ExpertRow& b) { return a.expert < b.expert; });
    std::vector<int64_t> starts;  // each chosen expert's first entry in `chosen`, then the end
    for (int64_t i = 0; i < count; ++i)
        if (i == 0 || chosen[i].expert != chosen[i - 1].expert) starts.push_back(i);
    starts.push_back(count);
    const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
    int64_t in_width = 0, wide = 0, mid_width = 0;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t e = chosen[starts[g]].expert;
        in_width = std::max(in_width, gate_up[e].padded);
        wide = std::max(wide, gate_up[e].out);
        mid_width = std::max(mid_width, down[e].padded);
    }
    auto up16 = [](int64_t n) { return (n + 15) / 16 * 16; };
    const int64_t stride_in = up16(in_width), stride_wide = up16(wide);
    const int64_t stride_mid = up16(std::max(mid_width, wide / 2)), stride_out = up16(width);
    // Every chosen (row, expert) pair has its own rows in each buffer: experts run side by side.
    float* inputs = aligned_floats(
        moe_buffer, count * (stride_in + stride_wide + 2 * stride_mid + stride_out));
    float* gate_ups = inputs + count * stride_in;
    float* activated = gate_ups + count * stride_wide;
    float* mids = activated + count * stride_mid;
    float* outputs = mids + count * stride_mid;
    // One expert's rows through it; `inner` threads split its outputs.
    auto run_expert = [&](int64_t g, int inner) {
        const int64_t first = starts[g], n = starts[g + 1] - first;
        const QLinear& gu = gate_up[chosen[first].expert];
        const QLinear& dn = down[chosen[first].expert];
        const int64_t ff = gu.out / 2;
        float* in = inputs + first * stride_in;
        float* wide_rows = gate_ups + first * stride_wide;
        float* act_rows = activated + first * stride_mid;
        // The expert's rows, zero beyond their width (the packed weights' padding).
        std::fill(in, in + n * gu.padded, 0.0f);
        for (int64_t i = 0; i < n; ++i)
            std::memcpy(in + i * gu.padded, x + chosen[first + i].row * width,
                        sizeof(float) * width);
        qlinear(in, n, gu, wide_rows, gu.out, inner);
        mh_gated_activation(wide_rows, n, ff, act, act_rows, 1);
        const float* mid = act_rows;
        if (dn.padded != ff) {
            float* padded = mids + first * stride_mid;
            std::fill(padded, padded + n * dn.padded, 0.0f);
            for (int64_t i = 0; i < n; ++i)
                std::memcpy(padded + i * dn.padded, act_rows + i * ff, sizeof(float) * ff);
            mid = padded;
        }
        qlinear(mid, n, dn, outputs + first * width, width, inner);
    };
    if (groups >= threads || threads == 1) {
        // Whole experts per thread: one parallel region for the layer's experts, each weight
        // streamed by one core.
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
        for (int64_t g = 0; g < groups; ++g) run_expert(g, 1);
    } else {
        for (int64_t g = 0; g < groups; ++g) run_expert(g, threads);
    }
    // Each row's outputs summed in expert order.
    std::fill(out, out + rows * width, 0.0f);
    for (int64_t i = 0; i < count; ++i) {
        const ExpertRow& c = chosen[i];
        float* target = out + c.row * width;
        const float* y = outputs + i * width;
        for (int64_t j = 0; j < width; ++j) target[j] += c.weight * y[j];
    }
}

// A mixture-of-experts MLP as models/networks/moe.py describes it (NativeExperts): the router's fp32
// weight, and each expert's packed weights.
struct NativeMoE {
    const float* router;     // [experts, width]
    const QLinear* gate_up;  // [experts]: gate and up outputs side by side
    const QLinear* down;     // [experts]
    int64_t experts, top_k;
    int32_t norm_topk;       // renormalise the chosen k weights to sum to 1
    int32_t act;             // mh_gated_activation's
};

// out [rows, width] = the MLP of x [rows, width]: each row's router probabilities (softmax of
// its logits), its top k experts (the first of equal ones), their weights (renormalised where
// asked), then mh_moe_experts. The module path (models/networks/moe.py) and mh_decode_layers both
// come here, so a row routes the same way in either.
extern "C" void mh_moe(const float* x, int64_t rows, int64_t width, const NativeMoE* moe,
                       float* out, int threads) {
    const int64_t experts = moe->experts, k = moe->top_k;
    std::vector<int64_t> ids(rows * k);
    std::vector<float> weights(rows * k);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows >= 4)
    for (int64_t r = 0; r < rows; ++r) {
        std::vector<float> p(experts);
        float largest = -INFINITY;
        for (int64_t e = 0; e < experts; ++e) {
            p[e] = dot(x + r * width, moe->router + e * width, width);
            largest = std::max(largest, p[e]);
        }
        float total = 0.0f;
        for (int64_t e = 0; e < experts; ++e) total += (p[e] = std::exp(p[e] - largest));
        for (int64_t e = 0; e < experts; ++e) p[e] /= total;
        float chosen_total = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < experts; ++e)
                if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
            ids[r * k + j] = best;
            weights[r * k + j] = p[best];
            chosen_total += p[best];
            p[best] = -1.0f;  // taken
        }
        if (moe->norm_topk)
            for (int64_t j = 0; j < k; ++j) weights[r * k + j] /= chosen_total;
    }
    mh_moe_experts(x, rows, width, ids.data(), weights.data(), k, moe->gate_up, moe->down,
                   moe->act, out, threads);
}
