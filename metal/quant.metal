// quant.metal: the quantized-weight kernels of one decode step.
//
// What they compute (numpy spec: moepack/runtime/kernels_ref.py; T = tokens, in/out = a projection's input
// and output widths, I = expert intermediate, D = hidden, K = experts per token, gs = group size):
//   qmv_b{2,4,8}, qmv_rec_b{2,4,8}   y[t, o] = sum_i x[t, i] * W[o, i]                       (kernels_ref.qmatmul)
//   gate_up_swiglu, gate_up_swiglu_rec, gate_up_swiglu_rec_b{2,4,8}
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
//                    experts in the batch (1 for the dense forms). A row block is RB = QMV_ROWS / NP rows
//                    (NP = 1 matrix for qmv, 2 for gate_up: a block is QMV_ROWS rows of codes either way).
//                    `ksplit` (a param: 1, 2, 4 or 8) simdgroups share each block, so a threadgroup holds
//                    NRB = QMV_SG / ksplit row blocks, RPG = NRB * RB rows. Simdgroup s of threadgroup
//                    (gx, t, z) works on rows (gx * NRB + s % NRB) * RB .. +RB-1 of token t, over input steps
//                    s / NRB, + ksplit, ... The launch builder picks ksplit so that a small dispatch (one
//                    expert's 1024 rows) still spreads over enough threadgroups to keep the GPU's loads in
//                    flight, and a large one (a batch of experts, lm_head) keeps ksplit = 1, as do rows that
//                    are a single step (in <= 32 * R, e.g. a 4-bit down projection: no step to share).
//                    A step is 32 lane runs of R consecutive inputs (bits: the wider of the two matrices'):
//                    16 bytes of codes per lane and row at 4 and 8 bits (32, 16 inputs), 8 bytes at 2 bits (32
//                    inputs, so a 1024-wide 2-bit row still fills the 32 lanes), so a simdgroup reads 512 or
//                    256 contiguous bytes of each row per step; a run lies inside one group (gs >= 32).
//                    Per threadgroup, x[t] is staged in threadgroup memory QMV_XCHUNK floats at a time (16 KiB:
//                    a 397B hidden vector in one go), as float4s xor-swizzled against bank conflicts, with the
//                    sum of each run (xsum), behind one barrier (stage_x). In a step a lane first issues all its
//                    loads (the runs of its RB rows x NP matrices, their scales and biases), then, word by word,
//                    reads the word's inputs (16 bytes at a time) and adds them times the codes of every row;
//                    each row then gets scale * dot(q, x) + bias * sum(x). Codes become floats without shifts
//                    or conversions (qdot_codes). With ksplit = 1 a simdgroup folds its 4 row sums over the 32
//                    lanes at once (simd_sum4) and writes its rows (no barrier); otherwise simd_sum folds each,
//                    the ksplit partial sums of a row meet in threadgroup memory, and thread (b * RB + r) adds
//                    them in k order and writes row r of block b.
//                    Vector reads (16 or 8 bytes, a run at once) need every row aligned to its run size: the
//                    buffer start (the launch builders align host arrays to 16; device buffers are), a
//                    record's component offset and stride (records: multiples of 64 and of 16 KiB), and the
//                    row size in * bits / 8. Otherwise (checked per threadgroup) the same code reads word by
//                    word.
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
#define QMV_VPT 16        // inputs in 16 bytes of 8-bit codes: a lane run is QMV_VPT * 8 / bits inputs
#define QMV_XCHUNK 4096   // floats of x staged in threadgroup memory at a time
#define QEMB_TG 64        // threads per threadgroup of qembed
#define QCOMB_TG 256      // threads per threadgroup of moe_combine

// ------------------------------------------------------------------------------------------- helpers

// One quantized matrix: packed codes, bf16 scales, bf16 biases (layouts in the header). `wbyte`: the byte
// offset of w from the start of its buffer (buffers start 16-byte aligned), so the kernel knows whether its
// rows can be read 16 bytes at a time.
struct qmat {
    device const uint* w;
    device const bfloat* scales;
    device const bfloat* biases;
    uint wbyte;
};

// The lane run of a qmv step for matrices with B0- and B1-bit codes (geometry in the header): R inputs of a
// row, QMV_VPT * 8 / B of them (16 bytes of the matrix with the wider codes) but at most 32 (2-bit: 8 bytes),
// so a run lies in one group (gs >= 32) and a 1024-wide 2-bit row still spreads over all 32 lanes. A run is
// R * B / 32 words of each matrix: 4, 2 or 1.
template <int B0, int B1>
struct qrun {
    enum { RW = QMV_VPT * 8 / (B0 > B1 ? B0 : B1), R = RW > 32 ? 32 : RW };
};

// x staged in threadgroup memory as float4s; float4 j lives at xs[xs_index(j)]: an xor swizzle inside each
// aligned block of 8 float4s, so the 8 lanes of a quarter simdgroup, reading float4 k of their runs (R / 4 =
// 8 or 4 float4s apart), hit different 16-byte bank groups (and the stagers' consecutive floats stay
// conflict-free).
METAL_FUNC uint xs_index(uint j) {
    return j ^ ((j >> 3) & 7u);
}

// Stage x[c0 .. c0+clen) of one token into threadgroup memory, and the sum of each lane run (R inputs) into
// xsum[clen / R]. Thread `tid` stages the 16 consecutive inputs from 16 * tid (QMV_XCHUNK is 16 per thread), 16
// bytes at a time when `xvec` (the row starts 16-byte aligned) and sums them float4 by float4; a run is one
// thread's 16 (R = 16) or a pair's 32 (R = 32: the two halves added across the pair with a shuffle). So the
// chunk needs one barrier after the stores, plus one before them from the second chunk on (the previous
// chunk's readers). Every thread of the group calls it.
template <int R>
METAL_FUNC void stage_x(device const float* xt, uint c0, uint clen, bool xvec, threadgroup float4* xs,
                        threadgroup float* xsum, uint tid) {
    if (c0 != 0u) {  // uniform over the group
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    const uint i = 16u * tid;
    const bool mine = i < clen;  // clen is a multiple of 32: a thread stages all of its 16 inputs or none
    // all four loads first, then the stores: a store right after its load would wait out each load in turn
    float4 v[4];
#pragma clang loop unroll(full)
    for (uint k = 0; k < 4; ++k) {
        v[k] = float4(0.0f);
    }
    if (mine && xvec) {
#pragma clang loop unroll(full)
        for (uint k = 0; k < 4; ++k) {
            v[k] = *((device const float4*)(xt + c0 + i) + k);
        }
    } else if (mine) {
#pragma clang loop unroll(full)
        for (uint k = 0; k < 4; ++k) {
            device const float* p = xt + c0 + i + 4 * k;
            v[k] = float4(p[0], p[1], p[2], p[3]);
        }
    }
    float s = 0.0f;
#pragma clang loop unroll(full)
    for (uint k = 0; k < 4; ++k) {
        if (mine) {
            xs[xs_index(4 * tid + k)] = v[k];
        }
        s += v[k].x + v[k].y + v[k].z + v[k].w;
    }
    if (R == 32) {
        s += simd_shuffle_xor(s, ushort(1));  // every lane takes part; pairs (2b, 2b + 1) share a simdgroup
    }
    if (mine && (R == 16 || (tid & 1u) == 0u)) {
        xsum[i / R] = s;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
}

// The sums over the simdgroup of four values per lane: lane l gets the sum of value
// 2 * (l >> 4 & 1) + (l >> 3 & 1) (lanes 0..7 a0, 8..15 a1, 16..23 a2, 24..31 a3): a butterfly that halves the
// values it carries while the first two strides fold, 6 shuffles instead of 4 simd_sums' 20.
METAL_FUNC float simd_sum4(float a0, float a1, float a2, float a3, uint lane) {
    const bool h16 = (lane & 16u) != 0u;
    const float b0 = (h16 ? a2 : a0) + simd_shuffle_xor(h16 ? a0 : a2, ushort(16));
    const float b1 = (h16 ? a3 : a1) + simd_shuffle_xor(h16 ? a1 : a3, ushort(16));
    const bool h8 = (lane & 8u) != 0u;
    float c = (h8 ? b1 : b0) + simd_shuffle_xor(h8 ? b0 : b1, ushort(8));
    c += simd_shuffle_xor(c, ushort(4));
    c += simd_shuffle_xor(c, ushort(2));
    c += simd_shuffle_xor(c, ushort(1));
    return c;
}

// N staged inputs from i0 (a multiple of 4) into registers, 16 bytes at a time.
template <int N>
METAL_FUNC void load_lane_x(threadgroup const float4* xs, uint i0, thread float* xv) {
#pragma clang loop unroll(full)
    for (uint k = 0; k < N / 4; ++k) {
        const float4 v = xs[xs_index((i0 >> 2) + k)];
        xv[4 * k] = v.x;
        xv[4 * k + 1] = v.y;
        xv[4 * k + 2] = v.z;
        xv[4 * k + 3] = v.w;
    }
}

// NW (4, 2 or 1) consecutive words of a row from p: one 16- or 8-byte load when VEC (the address is
// aligned), else word by word. The two kinds of load live in different instances (VEC a template
// parameter): in one function a compiler may merge them into word loads.
template <int NW, bool VEC>
METAL_FUNC void load_words(device const uint* p, thread uint* v) {
    if (NW == 4 && VEC) {
        const uint4 t = *((device const uint4*)p);
        v[0] = t.x;
        v[1] = t.y;
        v[2] = t.z;
        v[3] = t.w;
    } else if (NW == 2 && VEC) {
        const uint2 t = *((device const uint2*)p);
        v[0] = t.x;
        v[1] = t.y;
    } else {
#pragma clang loop unroll(full)
        for (uint k = 0; k < NW; ++k) {
            v[k] = p[k];
        }
    }
}

// acc + dot(codes first .. first+N-1 of word w, xv[0 .. N)), codes unscaled. Code k (bits kb = k * BITS ..)
// becomes a float without a shift: or-ed in place under the exponent 150 - kb, the float is 2^(23-kb) + q
// exactly, and subtracting that constant leaves q (an and-or and a subtract per code, no integer-to-float
// conversion). Codes that reach past bit 22 take the same path from w >> 16. `z` is 0 at run time, a value the
// compiler cannot see through: or-ed into the exponent words it keeps them in registers, so that the and-or
// of each code is one instruction on GPUs whose 3-input logic ops take a single immediate (NVIDIA's LOP3).
template <int BITS, int N>
METAL_FUNC float qdot_codes(uint w, uint first, thread const float* xv, float acc, uint z) {
    const uint mask = (1u << BITS) - 1u;
    const uint nlo = (23 - BITS) / BITS + 1;  // codes 0 .. nlo-1 end at or below bit 22
    const uint hi = w >> 16;
#pragma clang loop unroll(full)
    for (uint c = 0; c < N; ++c) {
        const uint k = first + c;
        const uint src = k < nlo ? w : hi;
        const uint kb = (k < nlo ? k : k - 16 / BITS) * BITS;
        const uint e = ((150u - kb) << 23) | z;
        const float q = as_type<float>((src & (mask << kb)) | e) - as_type<float>(e);
        acc = fma(q, xv[c], acc);
    }
    return acc;
}

// What a lane holds of one step for its rows (geometry in the header): NW words of each of ROWS rows of NP
// matrices, and the scale and bias of the run's group.
template <int NP, int ROWS>
struct qstep {
    uint v[NP][ROWS][4];
    bfloat s[NP][ROWS];
    bfloat b[NP][ROWS];
};

// The rows of a simdgroup: clamped row starts (words) of each matrix, and the first group of each row.
template <int ROWS>
struct qrows {
    uint w[2][ROWS];
    uint g[ROWS];
};

// Issue the loads of the step at input i (row offset): words, then the scale and bias of the run's group.
template <int B0, int B1, int NP, int ROWS, bool VEC>
METAL_FUNC void qstep_load(qmat m0, qmat m1, thread const qrows<ROWS>& rw, uint i, uint gshift,
                           thread qstep<NP, ROWS>& st) {
    typedef qrun<B0, B1> RUN;
    const uint g = i >> gshift;  // the run's group within the row
#pragma clang loop unroll(full)
    for (uint r = 0; r < ROWS; ++r) {
        load_words<RUN::R * B0 / 32, VEC>(m0.w + rw.w[0][r] + i * B0 / 32, st.v[0][r]);
        if (NP == 2) {
            load_words<RUN::R * B1 / 32, VEC>(m1.w + rw.w[1][r] + i * B1 / 32, st.v[NP - 1][r]);
        }
    }
#pragma clang loop unroll(full)
    for (uint r = 0; r < ROWS; ++r) {
        st.s[0][r] = m0.scales[rw.g[r] + g];
        st.b[0][r] = m0.biases[rw.g[r] + g];
        if (NP == 2) {
            st.s[NP - 1][r] = m1.scales[rw.g[r] + g];
            st.b[NP - 1][r] = m1.biases[rw.g[r] + g];
        }
    }
}

// Sum one loaded step (staged inputs from i0 within the chunk) into the row accumulators: per row,
// scale * dot(q, x) + bias * sum(x). Word by word over the rows, so only one word's inputs (32 / bits floats)
// are held in registers at a time; each row's dot is still summed in input order.
template <int B0, int B1, int NP, int ROWS>
METAL_FUNC void qstep_sum(thread const qstep<NP, ROWS>& st, threadgroup const float4* xs,
                          threadgroup const float* xsum, uint i0, uint z, thread float (&acc)[2][ROWS]) {
    typedef qrun<B0, B1> RUN;
    const uint NW0 = RUN::R * B0 / 32;        // words of a run, matrix 0
    const uint NW1 = RUN::R * B1 / 32;
    const uint NWX = NW0 > NW1 ? NW0 : NW1;   // words of the matrix with the wider codes
    const uint WX = RUN::R / NWX;             // inputs per word of that matrix (16, 8 or 4)
    float d[2][ROWS];
#pragma clang loop unroll(full)
    for (uint r = 0; r < ROWS; ++r) {
        d[0][r] = 0.0f;
        d[1][r] = 0.0f;
    }
#pragma clang loop unroll(full)
    for (uint j = 0; j < NWX; ++j) {
        float xv[WX];
        load_lane_x<WX>(xs, i0 + j * WX, xv);
#pragma clang loop unroll(full)
        for (uint r = 0; r < ROWS; ++r) {
            // a word of the narrower codes spans NWX / NW of these pieces: piece j % (NWX / NW) of it
            d[0][r] = qdot_codes<B0, WX>(st.v[0][r][j / (NWX / NW0)], j % (NWX / NW0) * WX, xv, d[0][r], z);
            if (NP == 2) {
                d[1][r] = qdot_codes<B1, WX>(st.v[NP - 1][r][j / (NWX / NW1)], j % (NWX / NW1) * WX, xv, d[1][r],
                                             z);
            }
        }
    }
    const float xs_r = xsum[i0 / RUN::R];
#pragma clang loop unroll(full)
    for (uint r = 0; r < ROWS; ++r) {
        acc[0][r] += fma(float(st.s[0][r]), d[0][r], float(st.b[0][r]) * xs_r);
        if (NP == 2) {
            acc[1][r] += fma(float(st.s[NP - 1][r]), d[1][r], float(st.b[NP - 1][r]) * xs_r);
        }
    }
}

// The matvec of one threadgroup (geometry in the header). NP = 1: y[t, o] = (W0 x[t])[o];
// NP = 2: y[t, o] = silu((W0 x[t])[o]) * (W1 x[t])[o] (W1 unused when NP = 1). VEC: every row of both
// matrices starts 16-byte aligned (qmv_core checks), so runs are read 16 bytes at a time and a 2-bit row
// (a multiple of 64 inputs then) never ends inside a run.
// xsum: threadgroup float [QMV_XCHUNK / 16], sums of the staged inputs (stage_x); part: threadgroup float
// [QMV_SG * QMV_ROWS * 2], the per-simdgroup sums folded in a fixed order. A simdgroup holds ROWS = QMV_ROWS / NP
// rows of each matrix (so qmv and gate_up both read QMV_ROWS rows a step). The row loops are unrolled and
// branch-free (rows past `out` are clamped to the last row and their results dropped). Each step first issues
// every load it needs (all rows' words, scales and biases), then sums; latency is hidden by the other
// simdgroups on the core rather than by holding a second step in registers (measured on an H200: prefetching
// the next step doubled the registers, halved the simdgroups per core and lost 10-25%).
template <int B0, int B1, int NP, bool VEC>
METAL_FUNC void qmv_tile(device const float* x, qmat m0, qmat m1, device float* y, uint in_dim, uint out_dim,
                         uint gs, uint ksplit, threadgroup float4* xs, threadgroup float* xsum,
                         threadgroup float* part, uint t, uint tgx, uint sg, uint tid, uint lane,
                         bool xvec) {
    typedef qrun<B0, B1> RUN;
    const uint R = RUN::R;
    const uint ROWS = QMV_ROWS / NP;   // rows per simdgroup (of each matrix)
    // ksplit is 1, 2, 4 or 8 (QMV_SG): shifts, not divisions by a runtime value (tens of instructions each)
    const uint kshift = uint(ksplit > 1u) + uint(ksplit > 2u) + uint(ksplit > 4u);
    const uint nrb = uint(QMV_SG) >> kshift;  // row blocks per threadgroup
    const uint rb = sg & (nrb - 1u);          // row block of this simdgroup
    static_assert(QMV_SG == 8, "kp below takes QMV_SG = 1 << 3");
    const uint kp = sg >> (3u - kshift);      // its share of the input steps
    const uint row0 = (tgx * nrb + rb) * ROWS;
    const uint gshift = gs == 32 ? 5u : (gs == 64 ? 6u : 7u);  // gs is 32, 64 or 128
    const uint ng = in_dim >> gshift;                            // groups per row
    const uint z = in_dim >> 31;                                 // 0 (in_dim < 2^31), opaque: see qdot_codes
    device const float* xt = x + t * in_dim;
    qrows<ROWS> rw;
    float acc[2][ROWS];
#pragma clang loop unroll(full)
    for (uint r = 0; r < ROWS; ++r) {
        const uint row = min(row0 + r, out_dim - 1);
        rw.w[0][r] = row * (in_dim * B0 / 32);
        rw.w[1][r] = row * (in_dim * B1 / 32);
        rw.g[r] = row * ng;
        acc[0][r] = 0.0f;
        acc[1][r] = 0.0f;
    }
    qstep<NP, ROWS> st;
    for (uint c0 = 0; c0 < in_dim; c0 += QMV_XCHUNK) {
        const uint clen = min((uint)QMV_XCHUNK, in_dim - c0);
        stage_x<R>(xt, c0, clen, xvec, xs, xsum, tid);
        for (uint i0 = (kp * 32 + lane) * R; i0 < clen; i0 += ksplit * 32 * R) {
            qstep_load<B0, B1, NP, ROWS, VEC>(m0, m1, rw, c0 + i0, gshift, st);
            qstep_sum<B0, B1, NP, ROWS>(st, xs, xsum, i0, z, acc);
        }
    }
    if (ksplit == 1u && QMV_ROWS == 4) {  // (uniform) a simdgroup owns its rows: fold its 4 sums at once
        // NP = 1: rows 0..3; NP = 2: gate rows 0, 1, then up rows 0, 1 (indices mod ROWS keep both compiling)
        const float c = simd_sum4(acc[0][0], acc[0][1 % ROWS], NP == 2 ? acc[1][0] : acc[0][2 % ROWS],
                                  NP == 2 ? acc[1][1 % ROWS] : acc[0][3 % ROWS], lane);
        const float u = NP == 2 ? simd_shuffle_xor(c, ushort(16)) : 0.0f;  // lanes 0..15: their row's up sum
        const uint r = lane >> 3;
        if ((lane & 7u) == 0u && r < ROWS && row0 + r < out_dim) {
            y[t * out_dim + row0 + r] = NP == 2 ? c / (1.0f + exp(-c)) * u : c;
        }
        return;
    }
    if (ksplit == 1u) {  // (uniform) as above, one row at a time: lane r writes row r
#pragma clang loop unroll(full)
        for (uint r = 0; r < ROWS; ++r) {
            const float v0 = simd_sum(acc[0][r]);
            const float v1 = NP == 2 ? simd_sum(acc[1][r]) : 0.0f;
            if (lane == r && row0 + r < out_dim) {
                y[t * out_dim + row0 + r] = NP == 2 ? v0 / (1.0f + exp(-v0)) * v1 : v0;
            }
        }
        return;
    }
    // fold the 32 lanes, then the ksplit simdgroups of each row block (in k order)
#pragma clang loop unroll(full)
    for (uint r = 0; r < ROWS; ++r) {
        const float s0 = simd_sum(acc[0][r]);
        const float s1 = NP == 2 ? simd_sum(acc[1][r]) : 0.0f;
        if (lane == 0) {
            part[(sg * ROWS + r) * 2] = s0;
            part[(sg * ROWS + r) * 2 + 1] = s1;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < nrb * ROWS) {
        const uint b = tid / ROWS;
        const uint r = tid % ROWS;
        const uint row = (tgx * nrb + b) * ROWS + r;
        float v0 = 0.0f;
        float v1 = 0.0f;
        for (uint k = 0; k < ksplit; ++k) {
            v0 += part[((k * nrb + b) * ROWS + r) * 2];
            v1 += part[((k * nrb + b) * ROWS + r) * 2 + 1];
        }
        if (row < out_dim) {
            // silu(g) = g / (1 + exp(-g)): exp overflow gives -0, as numpy
            y[t * out_dim + row] = NP == 2 ? v0 / (1.0f + exp(-v0)) * v1 : v0;
        }
    }
}

// qmv_tile with a run read at once (16 or 8 bytes) when both matrices' rows start aligned to it (the buffers
// start 16-byte aligned: the launch builders see to it; records' components do), word reads otherwise (a
// buffer or component offset off that alignment). The condition is uniform over the threadgroup.
template <int B0, int B1, int NP>
METAL_FUNC void qmv_core(device const float* x, qmat m0, qmat m1, device float* y, uint in_dim, uint out_dim,
                         uint gs, uint ksplit, threadgroup float4* xs, threadgroup float* xsum,
                         threadgroup float* part, uint t, uint tgx, uint sg, uint tid, uint lane,
                         uint x_stride = 0u) {
    const uint run0 = qrun<B0, B1>::R * B0 / 8;  // bytes of a run: 16, 8 (or 4 for the narrower of a pair)
    const uint run1 = qrun<B0, B1>::R * B1 / 8;
    const bool vec0 = ((m0.wbyte | (in_dim * B0 / 8)) & (run0 - 1u)) == 0u;
    const bool vec1 = NP == 1 || ((m1.wbyte | (in_dim * B1 / 8)) & (run1 - 1u)) == 0u;
    const bool xvec = (x_stride & 3u) == 0u;  // x rows 16-byte aligned (buffers are; in is a multiple of 32)
    if (vec0 && vec1) {  // (mixed-width gate/up pairs, rare, keep word reads: half the code)
        qmv_tile<B0, B1, NP, B0 == B1>(x, m0, m1, y, in_dim, out_dim, gs, ksplit, xs, xsum, part, t, tgx, sg, tid,
                                       lane, xvec);
    } else {
        qmv_tile<B0, B1, NP, false>(x, m0, m1, y, in_dim, out_dim, gs, ksplit, xs, xsum, part, t, tgx, sg, tid,
                                    lane, xvec);
    }
}

// Runtime (gate bits, up bits) -> the template instance; a pair outside {2,4,8}^2 computes nothing (the
// launch builder refuses it). The condition is uniform over the grid, so every thread meets the same barriers.
METAL_FUNC void gate_up_any(uint gate_bits, uint up_bits, device const float* x, qmat gate, qmat up, device float* h,
                        uint in_dim, uint out_dim, uint gs, uint ksplit, threadgroup float4* xs,
                        threadgroup float* xsum, threadgroup float* part, uint t, uint tgx, uint sg, uint tid,
                        uint lane, uint x_stride = 0u) {
    const uint pair = gate_bits * 16 + up_bits;
    if (pair == 0x22)
        qmv_core<2, 2, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, xsum, part, t, tgx, sg, tid, lane,
                          x_stride);
    if (pair == 0x24)
        qmv_core<2, 4, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, xsum, part, t, tgx, sg, tid, lane,
                          x_stride);
    if (pair == 0x28)
        qmv_core<2, 8, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, xsum, part, t, tgx, sg, tid, lane,
                          x_stride);
    if (pair == 0x42)
        qmv_core<4, 2, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, xsum, part, t, tgx, sg, tid, lane,
                          x_stride);
    if (pair == 0x44)
        qmv_core<4, 4, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, xsum, part, t, tgx, sg, tid, lane,
                          x_stride);
    if (pair == 0x48)
        qmv_core<4, 8, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, xsum, part, t, tgx, sg, tid, lane,
                          x_stride);
    if (pair == 0x82)
        qmv_core<8, 2, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, xsum, part, t, tgx, sg, tid, lane,
                          x_stride);
    if (pair == 0x84)
        qmv_core<8, 4, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, xsum, part, t, tgx, sg, tid, lane,
                          x_stride);
    if (pair == 0x88)
        qmv_core<8, 8, 2>(x, gate, up, h, in_dim, out_dim, gs, ksplit, xs, xsum, part, t, tgx, sg, tid, lane,
                          x_stride);
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
    threadgroup float4 xs[QMV_XCHUNK / 4];
    threadgroup float xsum[QMV_XCHUNK / 16];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    const qmat m = {w, scales, biases, 0u};
    qmv_core<2, 2, 1>(x, m, m, y + y_off, in_dim, out_dim, group_size, ksplit, xs, xsum, part, tg.y, tg.x, sg, tid,
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
    threadgroup float4 xs[QMV_XCHUNK / 4];
    threadgroup float xsum[QMV_XCHUNK / 16];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    const qmat m = {w, scales, biases, 0u};
    qmv_core<4, 4, 1>(x, m, m, y + y_off, in_dim, out_dim, group_size, ksplit, xs, xsum, part, tg.y, tg.x, sg, tid,
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
    threadgroup float4 xs[QMV_XCHUNK / 4];
    threadgroup float xsum[QMV_XCHUNK / 16];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    const qmat m = {w, scales, biases, 0u};
    qmv_core<8, 8, 1>(x, m, m, y + y_off, in_dim, out_dim, group_size, ksplit, xs, xsum, part, tg.y, tg.x, sg, tid,
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
    threadgroup float4 xs[QMV_XCHUNK / 4];
    threadgroup float xsum[QMV_XCHUNK / 16];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    device const uchar* r = rec + tg.z * rec_stride;  // expert tg.z of the batch
    const qmat m = {(device const uint*)(r + w_off), (device const bfloat*)(r + s_off),
                    (device const bfloat*)(r + b_off), tg.z * rec_stride + w_off};
    qmv_core<2, 2, 1>(x + tg.z * x_stride, m, m, y + y_off + tg.z * y_stride, in_dim, out_dim, group_size,
                       ksplit, xs, xsum, part, tg.y, tg.x, sg, tid, lane, x_stride);
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
    threadgroup float4 xs[QMV_XCHUNK / 4];
    threadgroup float xsum[QMV_XCHUNK / 16];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    device const uchar* r = rec + tg.z * rec_stride;  // expert tg.z of the batch
    const qmat m = {(device const uint*)(r + w_off), (device const bfloat*)(r + s_off),
                    (device const bfloat*)(r + b_off), tg.z * rec_stride + w_off};
    qmv_core<4, 4, 1>(x + tg.z * x_stride, m, m, y + y_off + tg.z * y_stride, in_dim, out_dim, group_size,
                       ksplit, xs, xsum, part, tg.y, tg.x, sg, tid, lane, x_stride);
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
    threadgroup float4 xs[QMV_XCHUNK / 4];
    threadgroup float xsum[QMV_XCHUNK / 16];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    device const uchar* r = rec + tg.z * rec_stride;  // expert tg.z of the batch
    const qmat m = {(device const uint*)(r + w_off), (device const bfloat*)(r + s_off),
                    (device const bfloat*)(r + b_off), tg.z * rec_stride + w_off};
    qmv_core<8, 8, 1>(x + tg.z * x_stride, m, m, y + y_off + tg.z * y_stride, in_dim, out_dim, group_size,
                       ksplit, xs, xsum, part, tg.y, tg.x, sg, tid, lane, x_stride);
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
    threadgroup float4 xs[QMV_XCHUNK / 4];
    threadgroup float xsum[QMV_XCHUNK / 16];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    const qmat gate = {gw, gsc, gbi, 0u};
    const qmat up = {uw, usc, ubi, 0u};
    gate_up_any(gate_bits, up_bits, x, gate, up, h, in_dim, out_dim, group_size, ksplit, xs, xsum, part, tg.y, tg.x, sg,
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
    threadgroup float4 xs[QMV_XCHUNK / 4];
    threadgroup float xsum[QMV_XCHUNK / 16];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    device const uchar* r = rec + tg.z * rec_stride;  // expert tg.z of the batch
    const qmat gate = {(device const uint*)(r + gw_off), (device const bfloat*)(r + gs_off),
                       (device const bfloat*)(r + gb_off), tg.z * rec_stride + gw_off};
    const qmat up = {(device const uint*)(r + uw_off), (device const bfloat*)(r + us_off),
                     (device const bfloat*)(r + ub_off), tg.z * rec_stride + uw_off};
    gate_up_any(gate_bits, up_bits, x + tg.z * x_stride, gate, up, h + tg.z * h_stride, in_dim, out_dim,
                group_size, ksplit, xs, xsum, part, tg.y, tg.x, sg, tid, lane, x_stride);
}

// gate_up_swiglu_rec_bN: gate_up_swiglu_rec for gate and up both N-bit (buffers as above; 12 and 13 must be N),
// the common case, as kernels of their own: a kernel's register budget is set by its heaviest path, so the
// 4-bit experts should not share one with the 2-bit ones (measured on an H200: gate/up of 10 4-bit experts
// 22.2 us alone vs 24.0 us inside the all-pairs kernel).
template <int B>
METAL_FUNC void gate_up_rec_uniform(device const float* x, device const uchar* rec, uint gw_off, uint gs_off,
                                    uint gb_off, uint uw_off, uint us_off, uint ub_off, device float* h,
                                    uint in_dim, uint out_dim, uint group_size, uint rec_stride, uint x_stride,
                                    uint h_stride, uint ksplit, threadgroup float4* xs, threadgroup float* xsum,
                                    threadgroup float* part, uint3 tg, uint tid, uint sg, uint lane) {
    device const uchar* r = rec + tg.z * rec_stride;  // expert tg.z of the batch
    const qmat gate = {(device const uint*)(r + gw_off), (device const bfloat*)(r + gs_off),
                       (device const bfloat*)(r + gb_off), tg.z * rec_stride + gw_off};
    const qmat up = {(device const uint*)(r + uw_off), (device const bfloat*)(r + us_off),
                     (device const bfloat*)(r + ub_off), tg.z * rec_stride + uw_off};
    qmv_core<B, B, 2>(x + tg.z * x_stride, gate, up, h + tg.z * h_stride, in_dim, out_dim, group_size, ksplit, xs,
                      xsum, part, tg.y, tg.x, sg, tid, lane, x_stride);
}

kernel void gate_up_swiglu_rec_b2(device const float* x [[buffer(0)]], device const uchar* rec [[buffer(1)]],
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
    threadgroup float4 xs[QMV_XCHUNK / 4];
    threadgroup float xsum[QMV_XCHUNK / 16];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    gate_up_rec_uniform<2>(x, rec, gw_off, gs_off, gb_off, uw_off, us_off, ub_off, h, in_dim, out_dim, group_size,
                           rec_stride, x_stride, h_stride, ksplit, xs, xsum, part, tg, tid, sg, lane);
}

kernel void gate_up_swiglu_rec_b4(device const float* x [[buffer(0)]], device const uchar* rec [[buffer(1)]],
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
    threadgroup float4 xs[QMV_XCHUNK / 4];
    threadgroup float xsum[QMV_XCHUNK / 16];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    gate_up_rec_uniform<4>(x, rec, gw_off, gs_off, gb_off, uw_off, us_off, ub_off, h, in_dim, out_dim, group_size,
                           rec_stride, x_stride, h_stride, ksplit, xs, xsum, part, tg, tid, sg, lane);
}

kernel void gate_up_swiglu_rec_b8(device const float* x [[buffer(0)]], device const uchar* rec [[buffer(1)]],
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
    threadgroup float4 xs[QMV_XCHUNK / 4];
    threadgroup float xsum[QMV_XCHUNK / 16];
    threadgroup float part[QMV_SG * QMV_ROWS * 2];
    gate_up_rec_uniform<8>(x, rec, gw_off, gs_off, gb_off, uw_off, us_off, ub_off, h, in_dim, out_dim, group_size,
                           rec_stride, x_stride, h_stride, ksplit, xs, xsum, part, tg, tid, sg, lane);
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
