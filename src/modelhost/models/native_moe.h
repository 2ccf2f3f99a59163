// A mixture-of-experts MLP's experts for a step (models/moe.py), included at the end of
// native_kernels.cpp: the step's rows grouped by the experts they chose, each chosen expert's
// packed weights read once for all its rows, and each row's weighted outputs summed over its
// experts in expert order (a row's result does not depend on the other rows).

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
    std::vector<ExpertRow> chosen;
    chosen.reserve(rows * k);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < k; ++j) chosen.push_back({ids[r * k + j], r, weights[r * k + j]});
    std::stable_sort(chosen.begin(), chosen.end(),
                     [](const ExpertRow& a, const ExpertRow& b) { return a.expert < b.expert; });
    std::fill(out, out + rows * width, 0.0f);
    int64_t in_width = 0, wide = 0, mid_width = 0;
    for (const ExpertRow& c : chosen) {
        in_width = std::max(in_width, gate_up[c.expert].padded);
        wide = std::max(wide, gate_up[c.expert].out);
        mid_width = std::max(mid_width, down[c.expert].padded);
    }
    auto up16 = [](int64_t n) { return (n + 15) / 16 * 16; };
    const int64_t stride_in = up16(in_width), stride_wide = up16(wide);
    const int64_t stride_mid = up16(std::max(mid_width, wide / 2)), stride_out = up16(width);
    float* inputs = aligned_floats(
        moe_buffer, rows * (stride_in + stride_wide + 2 * stride_mid + stride_out));
    float* gate_ups = inputs + rows * stride_in;
    float* activated = gate_ups + rows * stride_wide;
    float* mids = activated + rows * stride_mid;
    float* outputs = mids + rows * stride_mid;
    for (size_t first = 0; first < chosen.size();) {
        const int64_t expert = chosen[first].expert;
        size_t end = first;
        while (end < chosen.size() && chosen[end].expert == expert) ++end;
        const int64_t n = static_cast<int64_t>(end - first);
        const QLinear& gu = gate_up[expert];
        const QLinear& dn = down[expert];
        const int64_t ff = gu.out / 2;
        // The expert's rows, zero beyond their width (the packed weights' padding).
        std::fill(inputs, inputs + n * gu.padded, 0.0f);
        for (int64_t i = 0; i < n; ++i)
            std::memcpy(inputs + i * gu.padded, x + chosen[first + i].row * width,
                        sizeof(float) * width);
        qlinear(inputs, n, gu, gate_ups, gu.out, threads);
        mh_gated_activation(gate_ups, n, ff, act, activated, threads);
        const float* mid = activated;
        if (dn.padded != ff) {
            std::fill(mids, mids + n * dn.padded, 0.0f);
            for (int64_t i = 0; i < n; ++i)
                std::memcpy(mids + i * dn.padded, activated + i * ff, sizeof(float) * ff);
            mid = mids;
        }
        qlinear(mid, n, dn, outputs, width, threads);
        for (int64_t i = 0; i < n; ++i) {
            const ExpertRow& c = chosen[first + i];
            float* target = out + c.row * width;
            const float* y = outputs + i * width;
            for (int64_t j = 0; j < width; ++j) target[j] += c.weight * y[j];
        }
        first = end;
    }
}
