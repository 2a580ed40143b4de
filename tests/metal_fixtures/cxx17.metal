// Test fixture: `if constexpr` is C++17; MSL is C++14-based, so this must fail to compile.
#include <metal_stdlib>
using namespace metal;

template <int B> inline float pick(float a) {
  if constexpr (B == 4) {
    return a * 4.0f;
  } else {
    return a;
  }
}

kernel void uses_cxx17(device float* y [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  y[gid] = pick<4>(y[gid]);
}
