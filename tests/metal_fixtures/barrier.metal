// Test fixture: threadgroup sum through threadgroup memory, with and without the barrier between the
// writes and the read. x: [groups * T] float, out: [groups] float; grid (groups,1,1), threadgroup (T,1,1).
#include <metal_stdlib>
using namespace metal;

kernel void tg_sum_with_barrier(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                                uint g [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint tpg [[threads_per_threadgroup]]) {
  threadgroup float vals[1024];
  vals[tid] = x[g * tpg + tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    float s = 0.0f;
    for (uint i = 0; i < tpg; ++i) s += vals[i];
    out[g] = s;
  }
}

// The same kernel with the barrier forgotten: thread 0 may read slots other threads have not written.
kernel void tg_sum_missing_barrier(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                                   uint g [[threadgroup_position_in_grid]],
                                   uint tid [[thread_index_in_threadgroup]],
                                   uint tpg [[threads_per_threadgroup]]) {
  threadgroup float vals[1024];
  vals[tid] = x[g * tpg + tid];
  if (tid == 0) {
    float s = 0.0f;
    for (uint i = 0; i < tpg; ++i) s += vals[i];
    out[g] = s;
  }
}

// Early return before a barrier: threads past n leave, the rest wait forever on a Mac (undefined).
kernel void early_return(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                         constant uint& n [[buffer(2)]],
                         uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float vals[64];
  if (tid >= n) return;
  vals[tid] = x[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = vals[n - 1 - tid];
}

// A barrier inside a branch only some threads take.
kernel void divergent_barrier(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float vals[64];
  vals[tid] = float(tid);
  if (tid < 32) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = vals[63 - tid];
}
