// GGUF tensors repacked into the kernels' tiles (native_qlinear.h), losslessly: each block of
// the file is decoded to integer levels (float tensors are copied into float tiles), sub-scales and minimums exactly as ggml dequantizes
// it, then written into the tiles' bit planes. Plain C++: the loader streams a tensor at a
// time through here, 16 output rows a task, spread over threads.
//
// The GGUF block layouts (ggml-common.h), by type: bytes a block of `block` weights.
//   Q4_0  32: d, qs[16]                     w = d (q - 8)
//   Q4_1  32: d, m, qs[16]                  w = d q + m
//   Q5_0  32: d, qh[4], qs[16]              w = d (q - 16)
//   Q5_1  32: d, m, qh[4], qs[16]           w = d q + m
//   Q8_0  32: d, qs[32] (int8)              w = d q
//   Q2_K 256: scales[16], qs[64], d, dmin   w = d sc q - dmin m     (16-weight sub-blocks)
//   Q3_K 256: hmask[32], qs[64], scales[12], d          w = d (sc - 32) (q - 4)   (16)
//   Q4_K 256: d, dmin, scales[12], qs[128]  w = d sc q - dmin m     (32)
//   Q5_K 256: d, dmin, scales[12], qh[32], qs[128]      as Q4_K    (32)
//   Q6_K 256: ql[128], qh[64], scales[16] (int8), d     w = d sc (q - 32)        (16)
// (legacy types: value j and j + 16 of a block share qs[j]'s low and high nibble.)

#pragma once

#include "native_common.h"
#include "native_qlinear.h"

namespace {

struct BlockShape {
    int64_t weights, bytes;
};

BlockShape block_shape(int32_t format) {
    switch (format) {
        case kQ4_0: return {32, 18};
        case kQ4_1: return {32, 20};
        case kQ5_0: return {32, 22};
        case kQ5_1: return {32, 24};
        case kQ8_0: return {32, 34};
        case kQ2_K: return {256, 84};
        case kQ3_K: return {256, 110};
        case kQ4_K: return {256, 144};
        case kQ5_K: return {256, 176};
        case kQ6_K: return {256, 210};
        case kF32: return {1, 4};
        case kF16: case kBF16: return {1, 2};
        default: return {0, 0};
    }
}

int format_bits(int32_t format) {
    switch (format) {
        case kQ2_K: return 2;
        case kQ3_K: return 3;
        case kQ4_0: case kQ4_1: case kQ4_K: return 4;
        case kQ5_0: case kQ5_1: case kQ5_K: return 5;
        case kQ6_K: return 6;
        case kQ8_0: return 8;
        default: return 16;
    }
}

int64_t format_param_bytes(int32_t format) {
    switch (format) {
        case kQ4_0: return param_bytes<kQ4_0>();
        case kQ4_1: return param_bytes<kQ4_1>();
        case kQ5_0: return param_bytes<kQ5_0>();
        case kQ5_1: return param_bytes<kQ5_1>();
        case kQ8_0: return param_bytes<kQ8_0>();
        case kQ2_K: return param_bytes<kQ2_K>();
        case kQ3_K: return param_bytes<kQ3_K>();
        case kQ4_K: return param_bytes<kQ4_K>();
        case kQ5_K: return param_bytes<kQ5_K>();
        case kQ6_K: return param_bytes<kQ6_K>();
        default: return 0;
    }
}

bool is_super_format(int32_t format) { return format >= kQ2_K && format <= kQ6_K; }

uint16_t read_half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return h;
}

uint16_t float_to_half(float v) { return _cvtss_sh(v, 0); }

// One decoded output row: a level per input and its (sub-)block parameters.
struct DecodedRow {
    std::vector<uint8_t> levels;    // [in]
    std::vector<uint16_t> scale;    // legacy: fp16 per 32 inputs
    std::vector<uint16_t> min;      // legacy Q4_1, Q5_1: fp16 per 32 inputs
    std::vector<int8_t> sc, m;      // K types: per sub-block (16 or 32 inputs)
    std::vector<uint16_t> d, dmin;  // K types: fp16 per 256 inputs, dmin's sign folded in
};

// Q4_K and Q5_K's 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q3_K's 16 6-bit scales from their 12 packed bytes.
void scales_q3k(const uint8_t* packed, int8_t* out) {
    uint32_t aux[4];
    std::memcpy(aux, packed, 12);
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f, tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    std::memcpy(out, aux, 16);
}

// Decodes one row of `in` weights from `src` (the file's blocks) into `row`.
void decode_row(int32_t format, const uint8_t* src, int64_t in, DecodedRow& row) {
    const BlockShape shape = block_shape(format);
    const int64_t blocks = in / shape.weights;
    uint8_t* levels = row.levels.data();
    for (int64_t n = 0; n < blocks; ++n) {
        const uint8_t* b = src + n * shape.bytes;
        uint8_t* l = levels + n * shape.weights;
        switch (format) {
            case kQ4_0: case kQ4_1: {
                const uint8_t* qs = b + (format == kQ4_0 ? 2 : 4);
                row.scale[n] = read_half(b);
                if (format == kQ4_1) row.min[n] = read_half(b + 2);
                for (int j = 0; j < 16; ++j) {
                    l[j] = qs[j] & 0xF;
                    l[j + 16] = qs[j] >> 4;
                }
                break;
            }
            case kQ5_0: case kQ5_1: {
                const int offset = format == kQ5_0 ? 2 : 4;
                uint32_t qh;
                std::memcpy(&qh, b + offset, 4);
                const uint8_t* qs = b + offset + 4;
                row.scale[n] = read_half(b);
                if (format == kQ5_1) row.min[n] = read_half(b + 2);
                for (int j = 0; j < 16; ++j) {
                    l[j] = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
                    l[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
                }
                break;
            }
            case kQ8_0: {
                row.scale[n] = read_half(b);
                for (int j = 0; j < 32; ++j) l[j] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + j]) + 128);
                break;
            }
            case kQ2_K: {
                const uint8_t* scales = b;
                const uint8_t* qs = b + 16;
                row.d[n] = read_half(b + 80);
                row.dmin[n] = float_to_half(-half_to_float(read_half(b + 82)));
                for (int s = 0; s < 16; ++s) {
                    row.sc[16 * n + s] = static_cast<int8_t>(scales[s] & 0xF);
                    row.m[16 * n + s] = static_cast<int8_t>(scales[s] >> 4);
                }
                for (int half = 0; half < 2; ++half)
                    for (int j = 0; j < 4; ++j)
                        for (int i = 0; i < 16; ++i) {
                            l[128 * half + 32 * j + i] = (qs[32 * half + i] >> (2 * j)) & 3;
                            l[128 * half + 32 * j + 16 + i] = (qs[32 * half + 16 + i] >> (2 * j)) & 3;
                        }
                break;
            }
            case kQ3_K: {
                const uint8_t* hmask = b;
                const uint8_t* qs = b + 32;
                const float d = half_to_float(read_half(b + 108));
                row.d[n] = read_half(b + 108);
                row.dmin[n] = float_to_half(-4.0f * d);
                int8_t scales[16];
                scales_q3k(b + 96, scales);
                for (int s = 0; s < 16; ++s) row.sc[16 * n + s] = static_cast<int8_t>(scales[s] - 32);
                for (int half = 0; half < 2; ++half)
                    for (int j = 0; j < 4; ++j) {
                        const int bit = 4 * half + j;
                        for (int i = 0; i < 16; ++i) {
                            l[128 * half + 32 * j + i] = ((qs[32 * half + i] >> (2 * j)) & 3) |
                                                         (((hmask[i] >> bit) & 1) << 2);
                            l[128 * half + 32 * j + 16 + i] =
                                ((qs[32 * half + 16 + i] >> (2 * j)) & 3) |
                                (((hmask[16 + i] >> bit) & 1) << 2);
                        }
                    }
                break;
            }
            case kQ4_K: case kQ5_K: {
                const uint8_t* scales = b + 4;
                const uint8_t* qh = b + 16;  // Q5_K only
                const uint8_t* qs = b + (format == kQ4_K ? 16 : 48);
                row.d[n] = read_half(b);
                row.dmin[n] = float_to_half(-half_to_float(read_half(b + 2)));
                for (int s = 0; s < 8; ++s) {
                    uint8_t sc, m;
                    scale_min_k4(s, scales, &sc, &m);
                    row.sc[8 * n + s] = static_cast<int8_t>(sc);
                    row.m[8 * n + s] = static_cast<int8_t>(m);
                }
                for (int j = 0; j < 4; ++j)
                    for (int i = 0; i < 32; ++i) {
                        uint8_t lo = qs[32 * j + i] & 0xF, hi = qs[32 * j + i] >> 4;
                        if (format == kQ5_K) {
                            lo |= ((qh[i] >> (2 * j)) & 1) << 4;
                            hi |= ((qh[i] >> (2 * j + 1)) & 1) << 4;
                        }
                        l[64 * j + i] = lo;
                        l[64 * j + 32 + i] = hi;
                    }
                break;
            }
            case kQ6_K: {
                const uint8_t* ql = b;
                const uint8_t* qh = b + 128;
                const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
                const float d = half_to_float(read_half(b + 208));
                row.d[n] = read_half(b + 208);
                row.dmin[n] = float_to_half(-32.0f * d);
                for (int s = 0; s < 16; ++s) row.sc[16 * n + s] = scales[s];
                for (int half = 0; half < 2; ++half) {
                    const uint8_t* lo = ql + 64 * half;
                    const uint8_t* hi = qh + 32 * half;
                    uint8_t* v = l + 128 * half;
                    for (int i = 0; i < 32; ++i) {
                        v[i] = (lo[i] & 0xF) | (((hi[i] >> 0) & 3) << 4);
                        v[i + 32] = (lo[i + 32] & 0xF) | (((hi[i] >> 2) & 3) << 4);
                        v[i + 64] = (lo[i] >> 4) | (((hi[i] >> 4) & 3) << 4);
                        v[i + 96] = (lo[i + 32] >> 4) | (((hi[i] >> 6) & 3) << 4);
                    }
                }
                break;
            }
            default: break;
        }
    }
}

uint32_t load32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// Writes one tile's planes (see native_qlinear.h) from the levels of its 16 outputs: rows[o]
// points at output o's 32 levels of the group. Four levels at a time, as 32-bit words: byte
// k of word q of a row is its level 4q + k, which lands in byte 4o + k of register q.
template <int BITS>
void pack_tile(const uint8_t* const* rows, uint8_t* t) {
    constexpr uint32_t kOnes = 0x01010101u, kCrumbs = 0x03030303u, kNibbles = 0x0F0F0F0Fu;
    for (int o = 0; o < 16; ++o) {
        uint32_t w[8];
        for (int q = 0; q < 8; ++q) w[q] = load32(rows[o] + 4 * q);
        uint8_t* at = t + 4 * o;
        if constexpr (BITS == 8) {
            for (int q = 0; q < 8; ++q) store32(at + 64 * q, w[q]);
            continue;
        }
        if constexpr (BITS >= 4) {
            for (int j = 0; j < 4; ++j)
                store32(at + 64 * j, (w[2 * j] & kNibbles) | ((w[2 * j + 1] & kNibbles) << 4));
        }
        if constexpr (BITS == 5) {
            uint32_t plane = 0;
            for (int q = 0; q < 8; ++q) plane |= ((w[q] >> 4) & kOnes) << q;
            store32(at + 256, plane);
        }
        if constexpr (BITS == 6) {
            for (int c = 0; c < 2; ++c) {
                uint32_t plane = 0;
                for (int i = 0; i < 4; ++i) plane |= ((w[4 * c + i] >> 4) & kCrumbs) << (2 * i);
                store32(at + 256 + 64 * c, plane);
            }
        }
        if constexpr (BITS <= 3) {
            for (int c = 0; c < 2; ++c) {
                uint32_t plane = 0;
                for (int i = 0; i < 4; ++i) plane |= (w[4 * c + i] & kCrumbs) << (2 * i);
                store32(at + 64 * c, plane);
            }
        }
        if constexpr (BITS == 3) {
            uint32_t plane = 0;
            for (int q = 0; q < 8; ++q) plane |= ((w[q] >> 2) & kOnes) << q;
            store32(at + 128, plane);
        }
    }
}

void pack_tile_of(int bits, const uint8_t* const* rows, uint8_t* t) {
    switch (bits) {
        case 2: return pack_tile<2>(rows, t);
        case 3: return pack_tile<3>(rows, t);
        case 4: return pack_tile<4>(rows, t);
        case 5: return pack_tile<5>(rows, t);
        case 6: return pack_tile<6>(rows, t);
        default: return pack_tile<8>(rows, t);
    }
}

int64_t padded_inputs(int64_t in) { return (in + 63) / 64 * 64; }

}  // namespace

// Bytes of the three arrays (data, params, supers) of a [out, in] tensor of `format` once
// repacked; returns 0, or -1 where the format or the width is not supported.
extern "C" int mh_packed_sizes(int32_t format, int64_t out, int64_t in, int64_t* sizes) {
    const BlockShape shape = block_shape(format);
    if (shape.weights == 0 || in % shape.weights != 0) return -1;
    const int64_t blocks = (out + 15) / 16, groups = padded_inputs(in) / 32;
    if (is_float_format(format)) {
        sizes[0] = blocks * groups * float_tile_bytes(format);
        sizes[1] = sizes[2] = 0;
        return 0;
    }
    sizes[0] = blocks * groups * tile_bytes(format_bits(format));
    sizes[1] = blocks * groups * format_param_bytes(format);
    sizes[2] = is_super_format(format) ? blocks * (groups / 8) * 64 : 0;
    return 0;
}

// Repacks a row-major [out, in] tensor of GGUF blocks (`src`; F16/BF16: 16-bit floats) into
// data, params and supers (sized by mh_packed_sizes). Output row r of the result is the file's
// row order[r] (order null: r), which undoes llama.cpp's permutation of q and k rows.
extern "C" int mh_repack(int32_t format, const uint8_t* src, int64_t out, int64_t in,
                         const int64_t* order, uint8_t* data, uint8_t* params, uint16_t* supers,
                         int threads) {
    const BlockShape shape = block_shape(format);
    if (shape.weights == 0 || in % shape.weights != 0) return -1;
    const int64_t padded = padded_inputs(in), groups = padded / 32, blocks = (out + 15) / 16;
    const int64_t row_bytes = in / shape.weights * shape.bytes;
    const int bits = format_bits(format);
    const bool super = is_super_format(format);
    const int64_t pbytes = format_param_bytes(format), tile = tile_bytes(bits);
    const int64_t subs = padded / (format == kQ4_K || format == kQ5_K ? 32 : 16);
    // Plain threads, not OpenMP: an OpenMP team started here, on the loading thread, would
    // outlive the load beside the engine thread's own, and with more OpenMP threads than cores
    // libgomp stops spinning between parallel regions, which made a small model's decode steps
    // several times slower (each of a step's ~150 regions waiting for a sleeping thread).
    std::atomic<int64_t> next{0};
    auto work = [&]() {
        std::vector<DecodedRow> rows(16);
        for (auto& row : rows) {
            row.levels.assign(padded, 0);
            row.scale.assign(groups, 0);
            row.min.assign(groups, 0);
            row.sc.assign(subs, 0);
            row.m.assign(subs, 0);
            row.d.assign(padded / 256 + 1, 0);
            row.dmin.assign(padded / 256 + 1, 0);
        }
        alignas(64) static const uint8_t zeros[32] = {};
        const uint8_t* tile_rows[16];
        for (int64_t b = next++; b < blocks; b = next++) {
            if (is_float_format(format)) {  // 32 inputs by 16 outputs, as stored
                const int64_t size = format == kF32 ? 4 : 2, tile = float_tile_bytes(format);
                uint8_t* tiles = data + b * groups * tile;
                for (int64_t g = 0; g < groups; ++g)
                    for (int i = 0; i < 32; ++i)
                        for (int o = 0; o < 16; ++o) {
                            const int64_t r = 16 * b + o, col = 32 * g + i;
                            uint8_t* to = tiles + g * tile + size * (16 * i + o);
                            if (r < out && col < in)
                                std::memcpy(to, src + (order ? order[r] : r) * row_bytes + size * col,
                                            size);
                            else
                                std::memset(to, 0, size);
                        }
                continue;
            }
            for (int o = 0; o < 16; ++o) {
                DecodedRow& row = rows[o];
                const int64_t r = 16 * b + o;
                if (r < out) {
                    decode_row(format, src + (order ? order[r] : r) * row_bytes, in, row);
                } else {  // padding outputs: zero levels and parameters give zeros
                    std::fill(row.levels.begin(), row.levels.end(), 0);
                    std::fill(row.scale.begin(), row.scale.end(), 0);
                    std::fill(row.min.begin(), row.min.end(), 0);
                    std::fill(row.sc.begin(), row.sc.end(), 0);
                    std::fill(row.m.begin(), row.m.end(), 0);
                    std::fill(row.d.begin(), row.d.end(), 0);
                    std::fill(row.dmin.begin(), row.dmin.end(), 0);
                }
            }
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t at = b * groups + g;
                for (int o = 0; o < 16; ++o)  // levels past `in` were zeroed with the row
                    tile_rows[o] = 32 * g < in ? rows[o].levels.data() + 32 * g : zeros;
                pack_tile_of(bits, tile_rows, data + at * tile);
                uint8_t* p = params + at * pbytes;
                if (!super) {
                    uint16_t* halves = reinterpret_cast<uint16_t*>(p);
                    const bool inside = 32 * g < in;  // padding groups: zero scale and minimum
                    for (int o = 0; o < 16; ++o) {
                        halves[o] = inside ? rows[o].scale[g] : 0;
                        if (pbytes == 64) halves[16 + o] = inside ? rows[o].min[g] : 0;
                    }
                    continue;
                }
                // K types: in % 256 == 0, so no padding group; sub-blocks of 16 or 32.
                const bool halves = format == kQ2_K || format == kQ3_K || format == kQ6_K;
                const bool sym = format == kQ3_K || format == kQ6_K;
                const int stride = sym ? 16 : 32;
                for (int h = 0; h < (halves ? 2 : 1); ++h) {
                    const int64_t s = halves ? 2 * g + h : g;
                    for (int o = 0; o < 16; ++o) {
                        p[stride * h + o] = static_cast<uint8_t>(rows[o].sc[s]);
                        if (!sym) p[stride * h + 16 + o] = static_cast<uint8_t>(rows[o].m[s]);
                    }
                }
                if (g % 8 == 0) {
                    uint16_t* s = supers + (b * (groups / 8) + g / 8) * 32;
                    for (int o = 0; o < 16; ++o) {
                        s[o] = rows[o].d[g / 8];
                        s[16 + o] = rows[o].dmin[g / 8];
                    }
                }
            }
        }
    };
    std::vector<std::thread> helpers;
    for (int t = 1; t < std::min<int64_t>(threads, blocks); ++t) helpers.emplace_back(work);
    work();
    for (auto& helper : helpers) helper.join();
    return 0;
}
