// Test fixture: a threadgroup array passed where a device pointer is expected. Apple's compiler rejects
// it; the emulator's lax mode (empty address-space words) accepts it, strict mode rejects it.
#include <metal_stdlib>
using namespace metal;

inline void store_all(device float* dst, uint i, float v) { dst[i] = v; }

kernel void misuse(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tmp[32];
  store_all(tmp, tid, float(tid));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tmp[31 - tid];
}
