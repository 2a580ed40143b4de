// Test fixture: a histogram with threadgroup atomics, merged into device atomics.
// v: [N] uint values < 16, hist: [16] uint (zeroed by the caller). Grid (N/T,1,1), threadgroup (T,1,1).
#include <metal_stdlib>
using namespace metal;

kernel void histogram16(device const uint* v [[buffer(0)]], device atomic_uint* hist [[buffer(1)]],
                        device atomic_uint* maxv [[buffer(2)]],
                        uint gid [[thread_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup atomic_uint local[16];
  if (tid < 16) atomic_store_explicit(&local[tid], 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&local[v[gid] & 15u], 1u, memory_order_relaxed);
  atomic_fetch_max_explicit(maxv, v[gid], memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < 16) atomic_fetch_add_explicit(&hist[tid], atomic_load_explicit(&local[tid], memory_order_relaxed), memory_order_relaxed);
}
