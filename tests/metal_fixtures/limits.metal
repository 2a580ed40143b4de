// Test fixture: faults the emulator must turn into errors instead of wrong answers or a dead process.
#include <metal_stdlib>
using namespace metal;

// 40 KiB of threadgroup memory: over Metal's 32 KiB limit.
kernel void too_much_threadgroup(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[10240];
  big[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = big[tid];
}

// A wild pointer (an offset far past any buffer).
kernel void wild_write(device float* out [[buffer(0)]], constant ulong& offset [[buffer(1)]],
                       uint tid [[thread_index_in_threadgroup]]) {
  out[offset + tid] = 1.0f;
}

// Uninitialised threadgroup memory reads as the garbage pattern (NaN), not as zero.
kernel void read_uninitialised(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float vals[32];
  out[tid] = vals[tid];
}

// Off by one: the last thread reads x[n], one element past the end of x.
kernel void off_by_one(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                       uint tid [[thread_position_in_grid]]) {
  out[tid] = x[tid + 1];
}

// One array bound at two indices: a write through y must be visible through x.
kernel void alias_probe(device float* x [[buffer(0)]], device float* y [[buffer(1)]],
                        uint i [[thread_position_in_grid]]) {
  if (i == 0) {
    y[0] = 5.0f;
    x[1] = x[0] * 2.0f;
  }
}
