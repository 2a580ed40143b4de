// Test fixture and timing probe: y = W x for float W [rows, cols] (row-major), x [cols].
// One simdgroup per row, 8 rows per threadgroup: grid (rows / 8, 1, 1), threadgroup (256, 1, 1).
// x is staged through threadgroup memory in chunks of 1024.
#include <metal_stdlib>
using namespace metal;

#define MV_ROWS_PER_TG 8
#define MV_CHUNK 1024

kernel void matvec_f32(device const float* W [[buffer(0)]], device const float* x [[buffer(1)]],
                       device float* y [[buffer(2)]], constant uint& rows [[buffer(3)]],
                       constant uint& cols [[buffer(4)]],
                       uint tg [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint sg [[simdgroup_index_in_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float xs[MV_CHUNK];
  const uint row = tg * MV_ROWS_PER_TG + sg;
  float acc = 0.0f;
  for (uint c0 = 0; c0 < cols; c0 += MV_CHUNK) {
    const uint len = min(cols - c0, (uint)MV_CHUNK);
    for (uint i = tid; i < len; i += 256) xs[i] = x[c0 + i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (row < rows) {
      device const float4* w4 = (device const float4*)(W + (ulong)row * cols + c0);
      for (uint i = lane; i < len / 4; i += 32) {
        float4 xv = float4(xs[4 * i], xs[4 * i + 1], xs[4 * i + 2], xs[4 * i + 3]);
        acc += dot(w4[i], xv);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  acc = simd_sum(acc);
  if (row < rows && lane == 0) y[row] = acc;
}
