// Test fixture: MSL surface the stand-in header must get right, each output checked in numpy.
// x: [N] float; out: [8 * N] float (one block of N per expression). Grid (N/T,1,1), threadgroup (T,1,1).
#include <metal_stdlib>
using namespace metal;

constant float kTable[4] = {0.5f, 1.0f, 2.0f, 4.0f};
constexpr constant uint kMask = 3u;

template <typename T> inline T twice(T v) { return v + v; }

kernel void language(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                     constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  const float v = x[gid];
  out[0 * n + gid] = v * kTable[gid & kMask];
  out[1 * n + gid] = metal::fast::exp(v) + metal::precise::sqrt(fabs(v));
  int4 iv = int4(int(gid), -2, 3, -4);
  float4 fv = float4(iv);                                   // element-wise conversion, not a bit cast
  out[2 * n + gid] = fv.x + fv.y * 10.0f + dot(fv, float4(1.0f));
  out[3 * n + gid] = float(half(v) * 1.5h);
  out[4 * n + gid] = select(-1.0f, 1.0f, v > 0.0f) * clamp(abs(v), 0.25f, 1.0f);
  out[5 * n + gid] = float(as_type<half2>(as_type<uint>(v)).y);
  out[6 * n + gid] = twice(metal::max(v, 0.0f)) + float(min(gid, 7u));
  out[7 * n + gid] = tanh(v) + rsqrt(1.0f + v * v) + floor(v * 3.0f) + float(isnan(v / 0.0f));
}
