// glue.metal: the small elementwise and gather steps between the big kernels of a decode step, so the
// activations never leave the device (moepack/runtime/metal/resident.py): residual add, the sigmoid output
// gate, SwiGLU of separate gate/up outputs, the Gated-DeltaNet gates and q/k L2 normalisation, a gather
// (regrouping Qwen3-Next's fused projections), float (unquantized) matvec and embedding rows, a copy.
//
// What the kernels compute (spec: the *_ref functions of moepack/runtime/metal/ops_glue.py)
//   add_f32:           out[i] = a[i] + b[i]                                              (i < n)
//   sigmoid_gate_f32:  out[r, i] = x[r, i] * sigmoid(gate[r * gate_stride + gate_off + i])  (r < rows, i < width)
//   swiglu_f32:        out[i] = silu(g[i]) * u[i],   silu(z) = z / (1 + exp(-z))
//   gdn_gates_f32:     beta[h] = sigmoid(b[h]);  g[h] = exp(-A[h] * softplus(a[h] + dt_bias[h]))
//                      softplus(z) = max(z, 0) + log(1 + exp(-|z|))
//   l2norm_scale_f32:  y[r, :] = x[r, :] * rsqrt(sum_i x[r, i]^2 + eps) * (r < rows_a ? scale_a : scale_b)
//                      (Gated-DeltaNet q and k rows in one launch: q scaled by dk^-0.5, k by 1)
//   gather_f32:        dst[i] = src[idx[i]]
//   matvec_{f32,f16,bf16}: y[t, y_off + o] = sum_i x[t, i] * w[o, i]   (float weights, f32 accumulation)
//   embed_rows_{f32,f16,bf16}: out[t, d] = float(table[ids[t], d])
//   copy_f32:          dst[i] = src[i]
//
// Buffer layouts (f32 unless noted, contiguous)
//   add_f32:           0 a [n]   1 b [n]   2 out [n] (may alias a or b)   3 n (uint)
//   sigmoid_gate_f32:  0 x [rows, width]   1 gate [rows * gate_stride]   2 out [rows, width] (may alias x)
//                      3 rows   4 width   5 gate_stride   6 gate_off (uint)
//   swiglu_f32:        0 g [n]   1 u [n]   2 out [n] (may alias g or u)   3 n (uint)
//   gdn_gates_f32:     0 b [n]   1 a [n]   2 A [n] (exp(A_log))   3 dt_bias [n]   4 beta [n]   5 g [n]   6 n
//   l2norm_scale_f32:  0 x [rows, D]   1 y [rows, D] (may alias x)   2 D (uint)   3 rows_a (uint)
//                      4 scale_a (float)   5 scale_b (float)   6 eps (float)
//   gather_f32:        0 src [*]   1 idx [n] (int, each a valid index of src)   2 dst [n]   3 n (uint)
//   matvec_*:          0 x [T, in]   1 w [out, in] (float | half | bfloat)   2 y [T, >= y_off + out]
//                      3 in   4 out   5 y_off (uint)   6 y_stride (uint, elements between tokens' rows of y)
//   embed_rows_*:      0 ids [T] (int)   1 table [V, D] (float | half | bfloat)   2 out [T, D]   3 D (uint)
//   copy_f32:          0 src [n]   1 dst [n]   2 n (uint)
//
// Launch geometry (ops_glue builds these)
//   elementwise (add, sigmoid_gate, swiglu, gdn_gates, gather, copy): grid (ceil(n / 256), 1, 1),
//       threadgroup (256, 1, 1), a thread per element (n = rows * width for sigmoid_gate).
//   l2norm_scale_f32: grid (rows, 1, 1), threadgroup (tpg, 1, 1), tpg a multiple of 32 in [32, 1024];
//       each thread keeps its elements (tid + j * tpg, at most GLUE_NORM_PER = 8 of them, so D <= 8 * tpg)
//       in registers, the sum of squares is a simd_sum then one float per simdgroup through threadgroup
//       memory (one barrier), then each thread scales and writes its own elements (in place is safe).
//   matvec_*: grid (ceil(out / GLUE_MV_ROWS), T, 1), threadgroup (32 * GLUE_MV_ROWS, 1, 1): a simdgroup per
//       output row, lanes striding over the inputs, one simd_sum; rows past `out` compute nothing.
//   embed_rows_*: grid (ceil(D / 256), T, 1), threadgroup (256, 1, 1).

#include <metal_stdlib>
using namespace metal;

enum { GLUE_NORM_PER = 8, GLUE_NORM_MAX_SG = 32, GLUE_MV_ROWS = 8 };

inline float glue_sigmoid(float z) { return 1.0f / (1.0f + exp(-z)); }

kernel void add_f32(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                    device float* out [[buffer(2)]], constant uint& n [[buffer(3)]],
                    uint i [[thread_position_in_grid]])
{
    if (i < n) {
        out[i] = a[i] + b[i];
    }
}

kernel void sigmoid_gate_f32(device const float* x [[buffer(0)]], device const float* gate [[buffer(1)]],
                             device float* out [[buffer(2)]], constant uint& rows [[buffer(3)]],
                             constant uint& width [[buffer(4)]], constant uint& gate_stride [[buffer(5)]],
                             constant uint& gate_off [[buffer(6)]], uint i [[thread_position_in_grid]])
{
    if (i < rows * width) {
        uint r = i / width;
        uint c = i - r * width;
        out[i] = x[i] * glue_sigmoid(gate[r * gate_stride + gate_off + c]);
    }
}

kernel void swiglu_f32(device const float* g [[buffer(0)]], device const float* u [[buffer(1)]],
                       device float* out [[buffer(2)]], constant uint& n [[buffer(3)]],
                       uint i [[thread_position_in_grid]])
{
    if (i < n) {
        float z = g[i];
        out[i] = z * glue_sigmoid(z) * u[i];
    }
}

kernel void gdn_gates_f32(device const float* b [[buffer(0)]], device const float* a [[buffer(1)]],
                          device const float* A [[buffer(2)]], device const float* dt_bias [[buffer(3)]],
                          device float* beta [[buffer(4)]], device float* g [[buffer(5)]],
                          constant uint& n [[buffer(6)]], uint i [[thread_position_in_grid]])
{
    if (i < n) {
        float z = a[i] + dt_bias[i];
        float sp = max(z, 0.0f) + log(1.0f + exp(-fabs(z)));
        beta[i] = glue_sigmoid(b[i]);
        g[i] = exp(-A[i] * sp);
    }
}

kernel void l2norm_scale_f32(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                             constant uint& D [[buffer(2)]], constant uint& rows_a [[buffer(3)]],
                             constant float& scale_a [[buffer(4)]], constant float& scale_b [[buffer(5)]],
                             constant float& eps [[buffer(6)]],
                             uint row [[threadgroup_position_in_grid]], uint tpg [[threads_per_threadgroup]],
                             uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]],
                             uint nsg [[simdgroups_per_threadgroup]])
{
    threadgroup float part[GLUE_NORM_MAX_SG];
    device const float* xr = x + row * D;
    float v[GLUE_NORM_PER];
    float ss = 0.0f;
    for (uint j = 0; j < GLUE_NORM_PER; ++j) {
        uint i = tid + j * tpg;
        v[j] = i < D ? xr[i] : 0.0f;
        ss += v[j] * v[j];
    }
    ss = simd_sum(ss);
    if (lane == 0) {
        part[sg] = ss;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint s = 0; s < nsg; ++s) {
        total += part[s];
    }
    float f = rsqrt(total + eps) * (row < rows_a ? scale_a : scale_b);
    device float* yr = y + row * D;
    for (uint j = 0; j < GLUE_NORM_PER; ++j) {
        uint i = tid + j * tpg;
        if (i < D) {
            yr[i] = v[j] * f;
        }
    }
}

kernel void gather_f32(device const float* src [[buffer(0)]], device const int* idx [[buffer(1)]],
                       device float* dst [[buffer(2)]], constant uint& n [[buffer(3)]],
                       uint i [[thread_position_in_grid]])
{
    if (i < n) {
        dst[i] = src[idx[i]];
    }
}

kernel void copy_f32(device const float* src [[buffer(0)]], device float* dst [[buffer(1)]],
                     constant uint& n [[buffer(2)]], uint i [[thread_position_in_grid]])
{
    if (i < n) {
        dst[i] = src[i];
    }
}

// ------------------------------------------------------------------------------------------- float weights

template <typename W>
inline void matvec_impl(device const float* x, device const W* w, device float* y, uint in_dim, uint out_dim,
                        uint y_off, uint y_stride, uint row_block, uint t, uint sg, uint lane)
{
    uint o = row_block * GLUE_MV_ROWS + sg;  // uniform within the simdgroup
    if (o < out_dim) {
        device const float* xt = x + t * in_dim;
        device const W* wr = w + o * in_dim;
        float acc = 0.0f;
        for (uint i = lane; i < in_dim; i += 32) {
            acc = fma(float(wr[i]), xt[i], acc);
        }
        acc = simd_sum(acc);
        if (lane == 0) {
            y[t * y_stride + y_off + o] = acc;
        }
    }
}

kernel void matvec_f32(device const float* x [[buffer(0)]], device const float* w [[buffer(1)]],
                       device float* y [[buffer(2)]], constant uint& in_dim [[buffer(3)]],
                       constant uint& out_dim [[buffer(4)]], constant uint& y_off [[buffer(5)]],
                       constant uint& y_stride [[buffer(6)]], uint3 tg [[threadgroup_position_in_grid]],
                       uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]])
{
    matvec_impl<float>(x, w, y, in_dim, out_dim, y_off, y_stride, tg.x, tg.y, sg, lane);
}

kernel void matvec_f16(device const float* x [[buffer(0)]], device const half* w [[buffer(1)]],
                       device float* y [[buffer(2)]], constant uint& in_dim [[buffer(3)]],
                       constant uint& out_dim [[buffer(4)]], constant uint& y_off [[buffer(5)]],
                       constant uint& y_stride [[buffer(6)]], uint3 tg [[threadgroup_position_in_grid]],
                       uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]])
{
    matvec_impl<half>(x, w, y, in_dim, out_dim, y_off, y_stride, tg.x, tg.y, sg, lane);
}

kernel void matvec_bf16(device const float* x [[buffer(0)]], device const bfloat* w [[buffer(1)]],
                        device float* y [[buffer(2)]], constant uint& in_dim [[buffer(3)]],
                        constant uint& out_dim [[buffer(4)]], constant uint& y_off [[buffer(5)]],
                        constant uint& y_stride [[buffer(6)]], uint3 tg [[threadgroup_position_in_grid]],
                        uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]])
{
    matvec_impl<bfloat>(x, w, y, in_dim, out_dim, y_off, y_stride, tg.x, tg.y, sg, lane);
}

template <typename W>
inline void embed_rows_impl(device const int* ids, device const W* table, device float* out, uint D, uint t,
                            uint d)
{
    if (d < D) {
        out[t * D + d] = float(table[uint(ids[t]) * D + d]);
    }
}

kernel void embed_rows_f32(device const int* ids [[buffer(0)]], device const float* table [[buffer(1)]],
                           device float* out [[buffer(2)]], constant uint& D [[buffer(3)]],
                           uint3 gid [[thread_position_in_grid]])
{
    embed_rows_impl<float>(ids, table, out, D, gid.y, gid.x);
}

kernel void embed_rows_f16(device const int* ids [[buffer(0)]], device const half* table [[buffer(1)]],
                           device float* out [[buffer(2)]], constant uint& D [[buffer(3)]],
                           uint3 gid [[thread_position_in_grid]])
{
    embed_rows_impl<half>(ids, table, out, D, gid.y, gid.x);
}

kernel void embed_rows_bf16(device const int* ids [[buffer(0)]], device const bfloat* table [[buffer(1)]],
                            device float* out [[buffer(2)]], constant uint& D [[buffer(3)]],
                            uint3 gid [[thread_position_in_grid]])
{
    embed_rows_impl<bfloat>(ids, table, out, D, gid.y, gid.x);
}
