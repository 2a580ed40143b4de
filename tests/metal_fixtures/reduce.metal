// Test fixture: per-row sum of squares and rmsnorm-like scaling, with one threadgroup per row.
// x: [rows, n] float, out: [rows, n] float, sums: [rows] float. Grid (rows,1,1), threadgroup (T,1,1),
// T a multiple of 32, T <= 1024.
#include <metal_stdlib>
using namespace metal;

kernel void row_sumsq(
    device const float* x [[buffer(0)]],
    device float* sums [[buffer(1)]],
    constant uint& n [[buffer(2)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint tpg [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  float acc = 0.0f;
  for (uint i = tid; i < n; i += tpg) {
    float v = x[row * n + i];
    acc = fma(v, v, acc);
  }
  acc = simd_sum(acc);
  if (lane == 0) partial[sg] = acc;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float t = lane < nsg ? partial[lane] : 0.0f;
    t = simd_sum(t);
    if (lane == 0) sums[row] = t;
  }
}

// Element-wise: out = float4(x.x * s, x.y, x.zw) as a multi-argument vector constructor test.
kernel void scale_first(
    device const float4* x [[buffer(0)]],
    device float4* out [[buffer(1)]],
    constant float& s [[buffer(2)]],
    uint gid [[thread_position_in_grid]]) {
  float4 v = x[gid];
  out[gid] = float4(v.x * s, v.y, v.zw);
}
