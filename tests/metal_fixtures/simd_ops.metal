// Test fixture: simdgroup collectives and the stand-in header's types, checked element by element in
// numpy. x: [N] float (N = threads), out_*: [N]. Grid (N/T,1,1), threadgroup (T,1,1), T a multiple of 32.
#include <metal_stdlib>
using namespace metal;

kernel void simd_collectives(device const float* x [[buffer(0)]],
                             device float* out [[buffer(1)]],   // [6 * N]: one block per collective
                             device uint* lanes [[buffer(2)]],  // [N]: simd_prefix_exclusive_sum(1u)
                             uint gid [[thread_position_in_grid]],
                             uint lane [[thread_index_in_simdgroup]]) {
  const uint n = 32 * (gid / 32 + 1);  // not used for indexing; keeps the compiler honest
  float v = x[gid];
  uint N = n > 0 ? 0 : 1;  // 0
  (void)N;
  out[0 * 4096 + gid] = simd_sum(v);
  out[1 * 4096 + gid] = simd_max(v);
  out[2 * 4096 + gid] = simd_shuffle_xor(v, 1u);
  out[3 * 4096 + gid] = simd_shuffle_down(v, 3u);
  out[4 * 4096 + gid] = simd_broadcast(v, 5u);
  out[5 * 4096 + gid] = simd_prefix_inclusive_sum(v);
  lanes[gid] = simd_prefix_exclusive_sum(1u) + 100u * lane;
}

// Vectors, half, bfloat and as_type: y = float4(a.xy * 2, half(a.z), bfloat(a.w)) per element.
kernel void vector_types(device const float4* a [[buffer(0)]],
                         device float4* y [[buffer(1)]],
                         device half* h [[buffer(2)]],
                         device bfloat* b [[buffer(3)]],
                         device uint* bits [[buffer(4)]],
                         uint gid [[thread_position_in_grid]]) {
  float4 v = a[gid];
  float2 xy = v.xy * 2.0f;
  half hz = half(v.z);
  bfloat bw = bfloat(v.w);
  y[gid] = float4(xy, float(hz), float(bw));
  h[gid] = hz + 1.0h;
  b[gid] = bw;
  bits[gid] = as_type<uint>(v.x);
}

// simd_sum in divergent code: lax mode sums the active half, strict_simd rejects it.
kernel void divergent_simd(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                           uint gid [[thread_position_in_grid]],
                           uint lane [[thread_index_in_simdgroup]]) {
  float v = x[gid];
  if (lane < 16) {
    out[gid] = simd_sum(v);
  } else {
    out[gid] = -1.0f;
  }
}
