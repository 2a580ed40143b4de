// rope.metal: rotary position embedding, non-interleaved ("rotate half", MLX traditional=False), applied
// to the first rotary_dim dims of every head; the remaining dims pass through (Qwen3-Next / 3.5 turn 25%).
//
// What the kernel computes (spec: moepack/runtime/kernels_ref.py rope)
//   half = rotary_dim / 2; for token t, head h, i < half:
//       theta       = pos[t] * inv_freq[i]                (float32 product, as the reference)
//       y[t,h,i]      = x[t,h,i] * cos(theta) - x[t,h,i+half] * sin(theta)
//       y[t,h,i+half] = x[t,h,i] * sin(theta) + x[t,h,i+half] * cos(theta)
//       y[t,h,d]      = x[t,h,d]                          for rotary_dim <= d < hd
//   inv_freq[i] = exp(-i * log(base) / half) comes from the host (ops_seq computes it with the reference's
//   float32 expression), so every backend turns by bit-identical angles. theta grows with the position
//   (thousands of radians), so the kernel reduces it to [-pi, pi] itself before precise:: cos/sin.
//
// Buffer layouts (all f32, contiguous)
//   0 x [T, H, hd]   1 pos [T] (positions as float; linear RoPE scaling is the caller's)
//   2 inv_freq [half]   3 y [T, H, hd] (may alias x: each pair is read by the thread that writes it)
//   4 H (uint)   5 hd (uint)   6 half (uint, rotary_dim / 2, at most ROPE_MAX_HALF = 512)
//
// Launch geometry
//   grid        = (T, 1, 1)            one threadgroup per token
//   threadgroup = (tpg, 1, 1)          ops_seq picks tpg = clamp(roundup32(H * half), 32, 256)
//   The threadgroup first fills cos/sin for its token's half angles into threadgroup memory (shared by
//   all H heads), one barrier, then each thread turns pairs (h, i) with stride tpg and copies the
//   pass-through dims.

#include <metal_stdlib>
using namespace metal;

enum { ROPE_MAX_HALF = 512 };

kernel void rope_f32(device const float* x [[buffer(0)]],
                     device const float* pos [[buffer(1)]],
                     device const float* inv_freq [[buffer(2)]],
                     device float* y [[buffer(3)]],
                     constant uint& H [[buffer(4)]],
                     constant uint& hd [[buffer(5)]],
                     constant uint& half_dim [[buffer(6)]],
                     uint t [[threadgroup_position_in_grid]],
                     uint tpg [[threads_per_threadgroup]],
                     uint tid [[thread_index_in_threadgroup]])
{
    threadgroup float cos_t[ROPE_MAX_HALF];
    threadgroup float sin_t[ROPE_MAX_HALF];

    float p = pos[t];
    for (uint i = tid; i < half_dim; i += tpg) {
        float theta = p * inv_freq[i];
        // reduce to [-pi, pi] first (Cody-Waite, 2*pi in three parts; the first has 8 significant bits, so
        // n * part is exact for |n| < 2^16, i.e. |theta| < 4e5): sin/cos implementations that are only
        // accurate near zero (CUDA's sin.approx, Metal's fast::) then stay within ~1e-6
        float n = rint(theta * 0.159154943091895f);
        float r = fma(-n, 6.28125f, theta);
        r = fma(-n, 0.0019353072f, r);
        r = fma(-n, 1.0253132e-11f, r);
        cos_t[i] = precise::cos(r);
        sin_t[i] = precise::sin(r);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    device const float* xt = x + t * H * hd;
    device float* yt = y + t * H * hd;
    uint npairs = H * half_dim;
    for (uint e = tid; e < npairs; e += tpg) {
        uint h = e / half_dim;
        uint i = e - h * half_dim;
        uint d = h * hd + i;
        float a = xt[d];
        float b = xt[d + half_dim];
        float c = cos_t[i];
        float s = sin_t[i];
        yt[d] = fma(a, c, -(b * s));
        yt[d + half_dim] = fma(a, s, b * c);
    }
    uint rot = 2 * half_dim;
    uint pass = hd - rot;
    uint npass = H * pass;
    for (uint e = tid; e < npass; e += tpg) {
        uint h = e / pass;
        uint d = h * hd + rot + (e - h * pass);
        yt[d] = xt[d];
    }
}
