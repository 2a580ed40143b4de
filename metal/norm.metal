// norm.metal: RMSNorm and gated RMSNorm over the last axis, one threadgroup per row.
//
// What the kernels compute (spec: moepack/runtime/kernels_ref.py rmsnorm / gated_rmsnorm)
//   rmsnorm_f32 / rmsnorm_bf16:
//       y[r, i] = (x[r, i] * rsqrt(mean_i(x[r, :]^2) + eps)) * w[i]
//   gated_rmsnorm_f32 / gated_rmsnorm_bf16 (Qwen3-Next's RMSNormGated):
//       y[r, i] = rmsnorm(x)[r, i] * silu(z[r, i]),   silu(z) = z / (1 + exp(-z))
//   The _f32 entry points take float weights, the _bf16 ones bfloat weights (numpy uint16 bit patterns);
//   everything is computed in float32.
//
// Buffer layouts (f32 unless noted; a "row" is D contiguous values)
//   rmsnorm_*:        0 x [N rows, row r at x + r*x_stride]   1 w [D] (float | bfloat)
//                     2 y [N rows, row r at y + r*y_stride]   3 D (uint)   4 eps (float)
//                     5 x_stride (uint, elements)   6 y_stride (uint, elements)
//   gated_rmsnorm_*:  0 x [N, D]   1 z [N, D]   2 w [D] (float | bfloat)   3 y [N, D]   4 D (uint)
//                     5 eps (float); all three of x, z, y contiguous rows of D.
//   y may alias x (each thread reads its elements before writing them).
//   The strides let q/k norms read straight out of a projection whose rows hold more than one head part
//   (Qwen3-Next's q_proj yields [query | gate] per head).
//
// Launch geometry
//   grid        = (N, 1, 1)            one threadgroup per row
//   threadgroup = (tpg, 1, 1)          tpg a multiple of 32 in [32, 1024]; ops_seq picks
//                                      tpg = clamp(roundup32(ceil(D / 4)), 32, 1024)
//   Each thread keeps up to NORM_PER (8) of its row's values in registers (elements tid + j*tpg), so x
//   is read from memory once when D <= 8*tpg; longer rows re-read the tail. The sum of squares is reduced
//   with simd_sum, then across simdgroups through one float per simdgroup in threadgroup memory; every
//   simdgroup then sums those partials itself, so one barrier suffices.

#include <metal_stdlib>
using namespace metal;

enum { NORM_PER = 8, NORM_MAX_SIMDGROUPS = 32 };

// Sum of v over the threadgroup, returned to every thread. part: one float per simdgroup.
// Contains one barrier: every thread of the group must call it.
inline float norm_threadgroup_sum(float v, threadgroup float* part, uint lane, uint sg, uint nsg)
{
    v = simd_sum(v);
    if (lane == 0) {
        part[sg] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return simd_sum(lane < nsg ? part[lane] : 0.0f);
}

inline float norm_silu(float z)
{
    return z / (1.0f + metal::exp(-z));
}

// One row. GATED: multiply by silu(z) (z is ignored otherwise).
template <typename W, bool GATED>
inline void rmsnorm_row(device const float* x, device const float* z, device const W* w, device float* y,
                        uint D, float eps, uint tid, uint tpg, uint lane, uint sg, uint nsg,
                        threadgroup float* part)
{
    float xv[NORM_PER];
    float ss = 0.0f;
    for (uint j = 0; j < NORM_PER; ++j) {
        uint i = tid + j * tpg;
        xv[j] = i < D ? x[i] : 0.0f;
        ss = fma(xv[j], xv[j], ss);
    }
    for (uint i = tid + NORM_PER * tpg; i < D; i += tpg) {  // rows longer than NORM_PER * tpg
        float a = x[i];
        ss = fma(a, a, ss);
    }
    float total = norm_threadgroup_sum(ss, part, lane, sg, nsg);
    float inv = metal::rsqrt(total / float(D) + eps);

    for (uint j = 0; j < NORM_PER; ++j) {
        uint i = tid + j * tpg;
        if (i < D) {
            float o = (xv[j] * inv) * float(w[i]);
            if (GATED) {
                o *= norm_silu(z[i]);
            }
            y[i] = o;
        }
    }
    for (uint i = tid + NORM_PER * tpg; i < D; i += tpg) {
        float o = (x[i] * inv) * float(w[i]);
        if (GATED) {
            o *= norm_silu(z[i]);
        }
        y[i] = o;
    }
}

kernel void rmsnorm_f32(device const float* x [[buffer(0)]],
                        device const float* w [[buffer(1)]],
                        device float* y [[buffer(2)]],
                        constant uint& D [[buffer(3)]],
                        constant float& eps [[buffer(4)]],
                        constant uint& x_stride [[buffer(5)]],
                        constant uint& y_stride [[buffer(6)]],
                        uint row [[threadgroup_position_in_grid]],
                        uint tpg [[threads_per_threadgroup]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]],
                        uint nsg [[simdgroups_per_threadgroup]])
{
    threadgroup float part[NORM_MAX_SIMDGROUPS];
    rmsnorm_row<float, false>(x + row * x_stride, x, w, y + row * y_stride, D, eps, tid, tpg, lane, sg, nsg,
                              part);
}

kernel void rmsnorm_bf16(device const float* x [[buffer(0)]],
                         device const bfloat* w [[buffer(1)]],
                         device float* y [[buffer(2)]],
                         constant uint& D [[buffer(3)]],
                         constant float& eps [[buffer(4)]],
                         constant uint& x_stride [[buffer(5)]],
                         constant uint& y_stride [[buffer(6)]],
                         uint row [[threadgroup_position_in_grid]],
                         uint tpg [[threads_per_threadgroup]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint nsg [[simdgroups_per_threadgroup]])
{
    threadgroup float part[NORM_MAX_SIMDGROUPS];
    rmsnorm_row<bfloat, false>(x + row * x_stride, x, w, y + row * y_stride, D, eps, tid, tpg, lane, sg, nsg,
                               part);
}

kernel void gated_rmsnorm_f32(device const float* x [[buffer(0)]],
                              device const float* z [[buffer(1)]],
                              device const float* w [[buffer(2)]],
                              device float* y [[buffer(3)]],
                              constant uint& D [[buffer(4)]],
                              constant float& eps [[buffer(5)]],
                              uint row [[threadgroup_position_in_grid]],
                              uint tpg [[threads_per_threadgroup]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint nsg [[simdgroups_per_threadgroup]])
{
    threadgroup float part[NORM_MAX_SIMDGROUPS];
    rmsnorm_row<float, true>(x + row * D, z + row * D, w, y + row * D, D, eps, tid, tpg, lane, sg, nsg, part);
}

kernel void gated_rmsnorm_bf16(device const float* x [[buffer(0)]],
                               device const float* z [[buffer(1)]],
                               device const bfloat* w [[buffer(2)]],
                               device float* y [[buffer(3)]],
                               constant uint& D [[buffer(4)]],
                               constant float& eps [[buffer(5)]],
                               uint row [[threadgroup_position_in_grid]],
                               uint tpg [[threads_per_threadgroup]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint nsg [[simdgroups_per_threadgroup]])
{
    threadgroup float part[NORM_MAX_SIMDGROUPS];
    rmsnorm_row<bfloat, true>(x + row * D, z + row * D, w, y + row * D, D, eps, tid, tpg, lane, sg, nsg, part);
}
