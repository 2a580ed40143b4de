// quant.metal: the quantized-weight kernels of one decode step.
//
// What they compute (numpy spec: moepack/runtime/kernels_ref.py; T = tokens, in/out = a projection's input
// and output widths, I = expert intermediate, D = hidden, K = experts per token, gs = group size):
//   qmv_b{2,4,8}, qmv_rec_b{2,4,8}   y[t, o] = sum_i x[t, i] * W[o, i]                       (kernels_ref.qmatmul)
//   gate_up_swiglu, gate_up_swiglu_rec
//                                    h[t, o] = silu(gate(x)[t, o]) * up(x)[t, o],  silu(g) = g / (1 + exp(-g))
//                                    (expert_ffn = this, then qmv of the down projection on h)
//   qembed_b{2,4,8}                  e[t, :] = W[ids[t], :]                                   (kernels_ref.qembedding)
//   moe_combine, moe_combine_shared  out[t, d] = residual[t, d] + acc, where, in this order (float32),
//                                      acc  = sigmoid(shared_logit[t]) * shared[t, d]   (moe_combine_shared)
//                                      acc  = 0                                          (moe_combine)
//                                      acc += w[t, k] * y[t, k, d]   for k = 0 .. K-1 (fma allowed)
//                                    sigmoid(z) = 1 / (1 + exp(-z)). `out` may be the residual buffer itself.
//
// Weights: MLX affine, W[o, i] = scale[o, i / gs] * q[o, i] + bias[o, i / gs] (moepack/quant/affine_ref.py).
//   w       uint32 [out, in*bits/32]  codes little-end-first: code i of a row is bits (i*bits) % 32 .. +bits-1
//                                     of word (i*bits) / 32 (bits 2, 4, 8: codes never straddle words)
//   scales  bfloat [out, in/gs]       (bf16 bit patterns; numpy uint16)
//   biases  bfloat [out, in/gs]
//   gs is 32, 64 or 128 (a constant param; the launch builders in moepack/runtime/metal/ops_quant.py check it),
//   in is a multiple of gs.
// Two ways to pass one quantized matrix, both calling the same inline implementation:
//   * dense (qmv_bN, gate_up_swiglu, qembed_bN): w, scales and biases as three separate buffers. Used for
//     dense layers, the shared expert, the router, lm_head and the embedding table.
//   * record (qmv_rec_bN, gate_up_swiglu_rec): a routed expert's raw packed record (uchar, the bytes exactly
//     as pread put them; layout in moepack/layout/record.py) plus `constant uint&` byte offsets of each
//     component inside it, so a read can land directly in GPU-visible memory. A dense matrix can also go
//     this way through a uchar view of one buffer holding its three parts, with their byte offsets.
//   Byte offsets of uint32 components must be multiples of 4, of bfloat components multiples of 2. Records
//   satisfy this: weights are whole words, and a projection's scales and biases have the same size, so each
//   weight component starts at a multiple of 4 and each bf16 one at a multiple of 2.
//
// Launch geometry (mirrored by ops_quant.py; its tests compare the numbers below with it):
//   qmv*, gate_up*:  threadgroup (32 * QMV_SG, 1, 1) = QMV_SG simdgroups; grid (ceil(out / RPG), T, E), E =
//                    experts in the batch (1 for the dense forms). `ksplit` (a param: 1, 2, 4 or 8) simdgroups
//                    share each block of QMV_ROWS rows, so a threadgroup holds NRB = QMV_SG / ksplit row
//                    blocks, RPG = NRB * QMV_ROWS rows. Simdgroup s of threadgroup (gx, t, z) works on rows
//                    (gx * NRB + s % NRB) * QMV_ROWS .. +QMV_ROWS-1 of token t, over input steps s / NRB,
//                    + ksplit, ... (a step is 32 * QMV_VPT inputs). The launch builder picks ksplit so that a
//                    small dispatch (one expert's 1024 rows) still spreads over enough threadgroups to keep the
//                    GPU's loads in flight, and a large one (a batch of experts, lm_head) keeps ksplit = 1.
//                    Per threadgroup, x[t] is staged in threadgroup memory QMV_XCHUNK floats at a time (so
//                    any `in` fits in 8.5 KiB, padded against bank conflicts); in a step, lane l takes
//                    QMV_VPT consecutive inputs, loads them into registers once together with their sum, and
//                    for each of its rows adds  scale * dot(q, x) + bias * sum(x)  (the bias costs one
//                    multiply-add per QMV_VPT inputs). simd_sum folds the 32 lanes; the ksplit partial sums
//                    of a row meet in threadgroup memory, and thread (b * QMV_ROWS + r) adds them in k order
//                    and writes row r of block b. QMV_VPT (16) divides every group size, so a lane's inputs
//                    share one scale and bias.
//   qmv*:            writes y[y_off + t * out + o]; y_off lets the down projections of a token's K experts land
//                    in one [T, K, D] buffer for moe_combine (expert k of token t at y_off = (t * K + k) * D).
//   qembed_bN:       threadgroup (QEMB_TG, 1, 1), grid (ceil(D*bits/32 / QEMB_TG), T, 1); a thread
//                    decodes one packed word (32/bits values).
//   moe_combine*:    threadgroup (QCOMB_TG, 1, 1), grid (ceil(D / QCOMB_TG), T, 1); a thread per (t, d).
//                    y is float32 [T, K, D] (expert k of token t: its down-projection output), w [T, K],
//                    shared [T, D], shared_logit [T].
//
// Numerics: float32 throughout, reductions in a different order from dequantize-then-matmul (so not
// bit-equal to kernels_ref.qmatmul; the tests bound the difference); qembed is bit-exact (scale * q is exact
// in float32, so fma or not gives the same value).

#include <metal_stdlib>
using namespace metal;

#define QMV_SG 8          // simdgroups per threadgroup
#define QMV_ROWS 4        // output rows per simdgroup
#define QMV_VPT 16        // consecutive inputs per lane per step
#define QMV_XCHUNK 2048   // floats of x staged in threadgroup memory at a time
#define QEMB_TG 64        // threads per threadgroup of qembed
#define QCOMB_TG 256      // threads per threadgroup of moe_combine

// ------------------------------------------------------------------------------------------- helpers

// One quantized matrix: packed codes, bf16 scales, bf16 biases (layouts in the header).
struct qmat {
    device const uint* w;
    device const bfloat* scales;
    device const bfloat* biases;
};

// dot(codes, xv) over QMV_VPT consecutive codes starting at word w[0] (codes unscaled, as floats).
// A code c becomes the float c exactly as (bits of 2^23 | c) - 2^23, an or and a subtract instead of an
// integer-to-float conversion (quarter rate on NVIDIA GPUs; on an H200 the two timed the same, so this is
// not what limits the kernel there).
template <int BITS>
inline float qdot_lane(device const uint* w, thread const float* xv) {
    const uint per = 32 / BITS;  // codes per word
    const uint mask = (1u << BITS) - 1u;
    float acc = 0.0f;
#pragma clang loop unroll(full)
    for (uint j = 0; j < QMV_VPT / per; ++j) {
        const uint word = w[j];
#pragma clang loop unroll(full)
        for (uint k = 0; k < per; ++k) {
            const float q = as_type<float>(((word >> (k * BITS)) & mask) | 0x4B000000u) - 8388608.0f;
            acc = fma(q, xv[j * per + k], acc);
        }
    }
    return acc;
}

// One lane's share of a row of W . x for QMV_VPT inputs (held in xv, summing to xsum), whose codes start at
// word `word` of m.w and whose group is `group` (flat index into scales/biases):
// scale * dot(q, x) + bias * sum(x).
template <int BITS>
inline float qrow_part(qmat m, uint word, uint group, thread const float* xv, float xsum) {
    const float q = qdot_lane<BITS>(m.w + word, xv);
    return fma(float(m.scales[group]), q, float(m.biases[group]) * xsum);
}

// Input i of a staged chunk lives at xs[i + i / QMV_VPT]: one float of padding per lane's run, so the 32
// lanes of a simdgroup, reading runs QMV_VPT floats apart, hit 32 different banks instead of 16-way
// conflicting on 2 (on an H200 the padded and unpadded kernels timed the same).
inline uint xs_index(uint i) {
    return i + i / QMV_VPT;
}

// Stage x[c0 .. c0+clen) of one token into threadgroup memory. Every thread of the group calls it; the loop
// has a compile-time trip count so its loads are all in flight at once.
inline void stage_x(device const float* xt, uint c0, uint clen, threadgroup float* xs, uint tid) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous chunk's readers are done
#pragma clang loop unroll(full)
    for (uint k = 0; k < QMV_XCHUNK / (32 * QMV_SG); ++k) {
        const uint i = k * (32 * QMV_SG) + tid;
        if (i < clen) {
            xs[xs_index(i)] = xt[c0 + i];
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Lane's inputs i0 .. i0+QMV_VPT of the staged chunk (i0 a multiple of QMV_VPT) into registers; returns
// their sum.
inline float load_lane_x(threadgroup const float* xs, uint i0, thread float* xv) {
    threadgroup const float* run = xs + xs_index(i0);
    float s = 0.0f;
#pragma clang loop unroll(full)
    for (uint k = 0; k < QMV_VPT; ++k) {
        xv[k] = run[k];
        s += xv[k];
    }
    return s;
}

// The matvec of one threadgroup (geometry in the header). NP = 1: y[t, o] = (W0 x[t])[o];
// NP = 2: y[t, o] = silu((W0 x[t])[o]) * (W1 x[t])[o] (W1 unused when NP = 1).
// part: threadgroup float [QMV_SG * QMV_ROWS * 2], the per-simdgroup sums folded in a fixed order.
// The row loops are unrolled and branch-free (rows past `out` are clamped to the last row and their results
// dropped), so a lane issues the loads of all QMV_ROWS rows before it waits on any.
template <int B0, int B1, int NP>
inline void qmv_core(device const float* x, qmat m0, qmat m1, device float* y, uint in_dim, uint out_dim, uint gs,
                     uint ksplit, threadgroup float* xs, threadgroup float* part, uint t, uint tgx, uint sg,
                     uint tid, uint lane) {
    const uint nrb = QMV_SG / ksplit;  // row blocks per threadgroup
    const uint rb = sg % nrb;          // row block of this simdgroup
    const uint kp = sg / nrb;          // its share of the input steps
    const uint row0 = (tgx * nrb + rb) * QMV_ROWS;
    const uint gshift = gs == 32 ? 5u : (gs == 64 ? 6u : 7u);  // gs is 32, 64 or 128
    const uint ng = in_dim >> gshift;                            // groups per row
    device const float* xt = x + t * in_dim;
    uint wrow0[QMV_ROWS];  // first word of each row, matrix 0
    uint wrow1[QMV_ROWS];  // matrix 1
    uint grow[QMV_ROWS];   // first group of each row
    float a0[QMV_ROWS];
    float a1[QMV_ROWS];
#pragma clang loop unroll(full)
    for (uint r = 0; r < QMV_ROWS; ++r) {
        const uint row = min(row0 + r, out_dim - 1);
        wrow0[r] = row * (in_dim * B0 / 32);
        wrow1[r] = row * (in_dim * B1 / 32);
        grow[r] = row * ng;
        a0[r] = 0.0f;
        a1[r] = 0.0f;
    }
    for (uint c0 = 0; c0 < in_dim; c0 += QMV_XCHUNK) {
        const uint clen = min((uint)QMV_XCHUNK, in_dim - c0);
        stage_x(xt, c0, clen, xs, tid);
        for (uint i0 = (kp * 32 + lane) * QMV_VPT; i0 < clen; i0 += ksplit * 32 * QMV_VPT) {
            float xv[QMV_VPT];
            const float xsum = load_lane_x(xs, i0, xv);
            const uint i = c0 + i0;      // input index within the row
            const uint g = i >> gshift;  // its group within the row
#pragma clang loop unroll(full)
            for (uint r = 0; r < QMV_ROWS; ++r) {
                a0[r] += qrow_part<B0>(m0, wrow0[r] + i * B0 / 32, grow[r] + g, xv, xsum);
                if (NP == 2) {
                    a1[r] += qrow_part<B1>(m1, wrow1[r] + i * B1 / 32, grow[r] + g, xv, xsum);
                }
            }
        }
    }
    // fold the 32 lanes, then the ksplit simdgroups of each row block (in k order)
#pragma clang loop unroll(full)
    for (uint r = 0; r < QMV_ROWS; ++r) {
        const float s0 = simd_sum(a0[r]);
        const float s1 = NP == 2 ? simd_sum(a1[r]) : 0.0f;
        if (lane == 0) {
            part[(sg * QMV_ROWS + r) * 2] = s0;
            part[(sg * QMV_ROWS + r) * 2 + 1] = s1;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < nrb * QMV_ROWS) {
        const uint b = tid / QMV_ROWS;
        const uint r = tid % QMV_ROWS;
        const uint row = (tgx * nrb + b) * QMV_ROWS + r;
        float v0 = 0.0f;
        float v1 = 0.0f;
        for (uint k = 0; k < ksplit; ++k) {
            v0 += part[((k * nrb + b) * QMV_ROWS + r) * 2];
            v1 += part[((k * nrb + b) * QMV_ROWS + r) * 2 + 1];
        }
        if (row < out_dim) {
            // silu(g) = g / (1 + exp(-g)): exp overflow gives -0, as numpy
            y[t * out_dim + row] = NP == 2 ? v0 / (1.0f + exp(-v0)) * v1 : v0;
        }
    }
}

// Runtime (gate bits, up bits) -> the template instance; a pair outside {2,4,8}^2 computes nothing (the
// launch builder refuses it). The condition is uniform over the grid, so every thread meets the same barriers.
inline void gate_up_any(uint gate_bits, uint up_bits, device const float* x, qmat gate, qmat up, device float* h,
                        uint in_dim, uint out_dim, uint gs, uint ksplit, threadgroup float* xs,
                        threadgroup float* part, uint t, uint tgx, uint sg, uint tid, uint lane) {
    const uint pair = gate_bits * 16 + up_bits;
    if (pair == 0x22) qmv_core<2, 2, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, part, t, tgx, sg, tid, lane);
    if (pair == 0x24) qmv_core<2, 4, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, part, t, tgx, sg, tid, lane);
    if (pair == 0x28) qmv_core<2, 8, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, part, t, tgx, sg, tid, lane);
    if (pair == 0x42) qmv_core<4, 2, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, part, t, tgx, sg, tid, lane);
    if (pair == 0x44) qmv_core<4, 4, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, part, t, tgx, sg, tid, lane);
    if (pair == 0x48) qmv_core<4, 8, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, part, t, tgx, sg, tid, lane);
    if (pair == 0x82) qmv_core<8, 2, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, part, t, tgx, sg, tid, lane);
    if (pair == 0x84) qmv_core<8, 4, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, part, t, tgx, sg, tid, lane);
    if (pair == 0x88) qmv_core<8, 8, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, part, t, tgx, sg, tid, lane);
}

// ------------------------------------------------------------------------------------------- qmv

// Dense: buffers 0 x f32 [T, in], 1 w, 2 scales, 3 biases, 4 y f32, 5 in, 6 out, 7 group_size, 8 y_off,
// 9 ksplit.
kernel void qmv_b2(device const float* x [[buffer(0)]], device const uint* w [[buffer(1)]],
                   device const bfloat* scales [[buffer(2)]], device const bfloat* biases [[buffer(3)]],
                   device float* y [[buffer(4)]], constant uint& in_dim [[buffer(5)]],
                   constant uint& out_dim [[buffer(6)]], constant uint& group_size [[buffer(7)]],
                   constant uint& y_off [[buffer(8)]], constant uint& ksplit [[buffer(9)]],
                   uint3 tg [[threadgroup_position_in_grid]],
                   uint tid [[thread_index_in_threadgroup]],
                   uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float xs[QMV_XCHUNK + QMV_XCHUNK / QMV_VPT];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    const qmat m = {w, scales, biases};
    qmv_core<2, 2, 1>(x, m, m, y + y_off, in_dim, out_dim, group_size, ksplit, xs, part, tg.y, tg.x, sg, tid,
                       lane);
}

kernel void qmv_b4(device const float* x [[buffer(0)]], device const uint* w [[buffer(1)]],
                   device const bfloat* scales [[buffer(2)]], device const bfloat* biases [[buffer(3)]],
                   device float* y [[buffer(4)]], constant uint& in_dim [[buffer(5)]],
                   constant uint& out_dim [[buffer(6)]], constant uint& group_size [[buffer(7)]],
                   constant uint& y_off [[buffer(8)]], constant uint& ksplit [[buffer(9)]],
                   uint3 tg [[threadgroup_position_in_grid]],
                   uint tid [[thread_index_in_threadgroup]],
                   uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float xs[QMV_XCHUNK + QMV_XCHUNK / QMV_VPT];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    const qmat m = {w, scales, biases};
    qmv_core<4, 4, 1>(x, m, m, y + y_off, in_dim, out_dim, group_size, ksplit, xs, part, tg.y, tg.x, sg, tid,
                       lane);
}

kernel void qmv_b8(device const float* x [[buffer(0)]], device const uint* w [[buffer(1)]],
                   device const bfloat* scales [[buffer(2)]], device const bfloat* biases [[buffer(3)]],
                   device float* y [[buffer(4)]], constant uint& in_dim [[buffer(5)]],
                   constant uint& out_dim [[buffer(6)]], constant uint& group_size [[buffer(7)]],
                   constant uint& y_off [[buffer(8)]], constant uint& ksplit [[buffer(9)]],
                   uint3 tg [[threadgroup_position_in_grid]],
                   uint tid [[thread_index_in_threadgroup]],
                   uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float xs[QMV_XCHUNK + QMV_XCHUNK / QMV_VPT];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    const qmat m = {w, scales, biases};
    qmv_core<8, 8, 1>(x, m, m, y + y_off, in_dim, out_dim, group_size, ksplit, xs, part, tg.y, tg.x, sg, tid,
                       lane);
}

// Record: buffers 0 x f32 [T, in], 1 rec uchar, 2 w_off, 3 s_off, 4 b_off (bytes), 5 y f32, 6 in, 7 out,
// 8 group_size, 9 y_off, 10 rec_stride (bytes), 11 x_stride, 12 y_stride (floats), 13 ksplit. A batch of
// experts runs in one dispatch, grid.z = experts: expert z reads the record at rec + z * rec_stride, its input
// at x + z * x_stride (x_stride 0: every expert reads the same x) and writes y + y_off + z * y_stride.
kernel void qmv_rec_b2(device const float* x [[buffer(0)]], device const uchar* rec [[buffer(1)]],
                       constant uint& w_off [[buffer(2)]], constant uint& s_off [[buffer(3)]],
                       constant uint& b_off [[buffer(4)]], device float* y [[buffer(5)]],
                       constant uint& in_dim [[buffer(6)]], constant uint& out_dim [[buffer(7)]],
                       constant uint& group_size [[buffer(8)]], constant uint& y_off [[buffer(9)]],
                       constant uint& rec_stride [[buffer(10)]], constant uint& x_stride [[buffer(11)]],
                       constant uint& y_stride [[buffer(12)]], constant uint& ksplit [[buffer(13)]],
                       uint3 tg [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float xs[QMV_XCHUNK + QMV_XCHUNK / QMV_VPT];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    device const uchar* r = rec + tg.z * rec_stride;  // expert tg.z of the batch
    const qmat m = {(device const uint*)(r + w_off), (device const bfloat*)(r + s_off),
                    (device const bfloat*)(r + b_off)};
    qmv_core<2, 2, 1>(x + tg.z * x_stride, m, m, y + y_off + tg.z * y_stride, in_dim, out_dim, group_size,
                       ksplit, xs, part, tg.y, tg.x, sg, tid, lane);
}

kernel void qmv_rec_b4(device const float* x [[buffer(0)]], device const uchar* rec [[buffer(1)]],
                       constant uint& w_off [[buffer(2)]], constant uint& s_off [[buffer(3)]],
                       constant uint& b_off [[buffer(4)]], device float* y [[buffer(5)]],
                       constant uint& in_dim [[buffer(6)]], constant uint& out_dim [[buffer(7)]],
                       constant uint& group_size [[buffer(8)]], constant uint& y_off [[buffer(9)]],
                       constant uint& rec_stride [[buffer(10)]], constant uint& x_stride [[buffer(11)]],
                       constant uint& y_stride [[buffer(12)]], constant uint& ksplit [[buffer(13)]],
                       uint3 tg [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float xs[QMV_XCHUNK + QMV_XCHUNK / QMV_VPT];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    device const uchar* r = rec + tg.z * rec_stride;  // expert tg.z of the batch
    const qmat m = {(device const uint*)(r + w_off), (device const bfloat*)(r + s_off),
                    (device const bfloat*)(r + b_off)};
    qmv_core<4, 4, 1>(x + tg.z * x_stride, m, m, y + y_off + tg.z * y_stride, in_dim, out_dim, group_size,
                       ksplit, xs, part, tg.y, tg.x, sg, tid, lane);
}

kernel void qmv_rec_b8(device const float* x [[buffer(0)]], device const uchar* rec [[buffer(1)]],
                       constant uint& w_off [[buffer(2)]], constant uint& s_off [[buffer(3)]],
                       constant uint& b_off [[buffer(4)]], device float* y [[buffer(5)]],
                       constant uint& in_dim [[buffer(6)]], constant uint& out_dim [[buffer(7)]],
                       constant uint& group_size [[buffer(8)]], constant uint& y_off [[buffer(9)]],
                       constant uint& rec_stride [[buffer(10)]], constant uint& x_stride [[buffer(11)]],
                       constant uint& y_stride [[buffer(12)]], constant uint& ksplit [[buffer(13)]],
                       uint3 tg [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float xs[QMV_XCHUNK + QMV_XCHUNK / QMV_VPT];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    device const uchar* r = rec + tg.z * rec_stride;  // expert tg.z of the batch
    const qmat m = {(device const uint*)(r + w_off), (device const bfloat*)(r + s_off),
                    (device const bfloat*)(r + b_off)};
    qmv_core<8, 8, 1>(x + tg.z * x_stride, m, m, y + y_off + tg.z * y_stride, in_dim, out_dim, group_size,
                       ksplit, xs, part, tg.y, tg.x, sg, tid, lane);
}

// ------------------------------------------------------------------------------------------- gate/up + SwiGLU

// Dense: buffers 0 x f32 [T, D], 1 gate w, 2 gate scales, 3 gate biases, 4 up w, 5 up scales, 6 up biases,
// 7 h f32 [T, I], 8 in (D), 9 out (I), 10 group_size, 11 gate_bits, 12 up_bits, 13 ksplit.
kernel void gate_up_swiglu(device const float* x [[buffer(0)]], device const uint* gw [[buffer(1)]],
                           device const bfloat* gsc [[buffer(2)]], device const bfloat* gbi [[buffer(3)]],
                           device const uint* uw [[buffer(4)]], device const bfloat* usc [[buffer(5)]],
                           device const bfloat* ubi [[buffer(6)]], device float* h [[buffer(7)]],
                           constant uint& in_dim [[buffer(8)]], constant uint& out_dim [[buffer(9)]],
                           constant uint& group_size [[buffer(10)]], constant uint& gate_bits [[buffer(11)]],
                           constant uint& up_bits [[buffer(12)]], constant uint& ksplit [[buffer(13)]],
                           uint3 tg [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float xs[QMV_XCHUNK + QMV_XCHUNK / QMV_VPT];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    const qmat gate = {gw, gsc, gbi};
    const qmat up = {uw, usc, ubi};
    gate_up_any(gate_bits, up_bits, x, gate, up, h, in_dim, out_dim, group_size, ksplit, xs, part, tg.y, tg.x, sg,
                tid, lane);
}

// Record: buffers 0 x f32 [T, D], 1 rec uchar, 2..7 byte offsets of gate weight, gate scales, gate biases,
// up weight, up scales, up biases, 8 h f32 [T, I], 9 in (D), 10 out (I), 11 group_size, 12 gate_bits,
// 13 up_bits, 14 rec_stride (bytes), 15 x_stride, 16 h_stride (floats), 17 ksplit: a batch of experts as in
// qmv_rec_bN.
kernel void gate_up_swiglu_rec(device const float* x [[buffer(0)]], device const uchar* rec [[buffer(1)]],
                               constant uint& gw_off [[buffer(2)]], constant uint& gs_off [[buffer(3)]],
                               constant uint& gb_off [[buffer(4)]], constant uint& uw_off [[buffer(5)]],
                               constant uint& us_off [[buffer(6)]], constant uint& ub_off [[buffer(7)]],
                               device float* h [[buffer(8)]], constant uint& in_dim [[buffer(9)]],
                               constant uint& out_dim [[buffer(10)]], constant uint& group_size [[buffer(11)]],
                               constant uint& gate_bits [[buffer(12)]], constant uint& up_bits [[buffer(13)]],
                               constant uint& rec_stride [[buffer(14)]], constant uint& x_stride [[buffer(15)]],
                               constant uint& h_stride [[buffer(16)]], constant uint& ksplit [[buffer(17)]],
                               uint3 tg [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float xs[QMV_XCHUNK + QMV_XCHUNK / QMV_VPT];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    device const uchar* r = rec + tg.z * rec_stride;  // expert tg.z of the batch
    const qmat gate = {(device const uint*)(r + gw_off), (device const bfloat*)(r + gs_off),
                       (device const bfloat*)(r + gb_off)};
    const qmat up = {(device const uint*)(r + uw_off), (device const bfloat*)(r + us_off),
                     (device const bfloat*)(r + ub_off)};
    gate_up_any(gate_bits, up_bits, x + tg.z * x_stride, gate, up, h + tg.z * h_stride, in_dim, out_dim,
                group_size, ksplit, xs, part, tg.y, tg.x, sg, tid, lane);
}

// ------------------------------------------------------------------------------------------- embedding

// Buffers 0 ids int32 [T], 1 w uint32 [V, D*bits/32], 2 scales, 3 biases (bfloat [V, D/gs]), 4 e f32 [T, D],
// 5 dim (D), 6 group_size. ids must lie in 0 .. V-1 (the launch builder checks).
template <int BITS>
inline void qembed_impl(device const int* ids, device const uint* w, device const bfloat* scales,
                        device const bfloat* biases, device float* e, uint dim, uint gs, uint t, uint j) {
    const uint per = 32 / BITS;
    const uint nw = dim / per;
    if (j < nw) {
        const uint row = (uint)ids[t];
        const uint word = w[row * nw + j];
        const uint i = j * per;  // first value of this word
        const uint g = row * (dim / gs) + i / gs;
        const float s = float(scales[g]);
        const float b = float(biases[g]);
        for (uint k = 0; k < per; ++k) {
            e[t * dim + i + k] = s * float((word >> (k * BITS)) & ((1u << BITS) - 1u)) + b;
        }
    }
}

kernel void qembed_b2(device const int* ids [[buffer(0)]], device const uint* w [[buffer(1)]],
                      device const bfloat* scales [[buffer(2)]], device const bfloat* biases [[buffer(3)]],
                      device float* e [[buffer(4)]], constant uint& dim [[buffer(5)]],
                      constant uint& group_size [[buffer(6)]], uint3 gid [[thread_position_in_grid]]) {
    qembed_impl<2>(ids, w, scales, biases, e, dim, group_size, gid.y, gid.x);
}

kernel void qembed_b4(device const int* ids [[buffer(0)]], device const uint* w [[buffer(1)]],
                      device const bfloat* scales [[buffer(2)]], device const bfloat* biases [[buffer(3)]],
                      device float* e [[buffer(4)]], constant uint& dim [[buffer(5)]],
                      constant uint& group_size [[buffer(6)]], uint3 gid [[thread_position_in_grid]]) {
    qembed_impl<4>(ids, w, scales, biases, e, dim, group_size, gid.y, gid.x);
}

kernel void qembed_b8(device const int* ids [[buffer(0)]], device const uint* w [[buffer(1)]],
                      device const bfloat* scales [[buffer(2)]], device const bfloat* biases [[buffer(3)]],
                      device float* e [[buffer(4)]], constant uint& dim [[buffer(5)]],
                      constant uint& group_size [[buffer(6)]], uint3 gid [[thread_position_in_grid]]) {
    qembed_impl<8>(ids, w, scales, biases, e, dim, group_size, gid.y, gid.x);
}

// ------------------------------------------------------------------------------------------- MoE combine

// Buffers 0 residual f32 [T, D], 1 y f32 [T, K, D], 2 w f32 [T, K], 3 out f32 [T, D], 4 dim (D), 5 k (K),
// 6 tokens (T); moe_combine_shared adds 7 shared f32 [T, D], 8 shared_logit f32 [T].
inline void combine_impl(device const float* residual, device const float* y, device const float* w,
                         device float* out, uint dim, uint k, uint tokens, float acc, uint t, uint d) {
    for (uint j = 0; j < k; ++j) {
        acc = fma(w[t * k + j], y[(t * k + j) * dim + d], acc);
    }
    out[t * dim + d] = residual[t * dim + d] + acc;
}

kernel void moe_combine(device const float* residual [[buffer(0)]], device const float* y [[buffer(1)]],
                        device const float* w [[buffer(2)]], device float* out [[buffer(3)]],
                        constant uint& dim [[buffer(4)]], constant uint& k [[buffer(5)]],
                        constant uint& tokens [[buffer(6)]], uint3 gid [[thread_position_in_grid]]) {
    if (gid.x < dim && gid.y < tokens) {
        combine_impl(residual, y, w, out, dim, k, tokens, 0.0f, gid.y, gid.x);
    }
}

kernel void moe_combine_shared(device const float* residual [[buffer(0)]], device const float* y [[buffer(1)]],
                               device const float* w [[buffer(2)]], device float* out [[buffer(3)]],
                               constant uint& dim [[buffer(4)]], constant uint& k [[buffer(5)]],
                               constant uint& tokens [[buffer(6)]], device const float* shared [[buffer(7)]],
                               device const float* shared_logit [[buffer(8)]],
                               uint3 gid [[thread_position_in_grid]]) {
    if (gid.x < dim && gid.y < tokens) {
        const float gate = 1.0f / (1.0f + exp(-shared_logit[gid.y]));
        combine_impl(residual, y, w, out, dim, k, tokens, gate * shared[gid.y * dim + gid.x], gid.y, gid.x);
    }
}
