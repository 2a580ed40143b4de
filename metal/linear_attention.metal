// linear_attention.metal: the two recurrent pieces of a Gated-DeltaNet layer (Qwen3-Next / Qwen3.5),
// the short causal conv and the gated delta rule, both updating their recurrent state IN PLACE.
//
// What the kernels compute (spec: moepack/runtime/kernels_ref.py conv1d_step / gated_delta)
//   conv1d_step_f32: depthwise causal conv over time plus SiLU; P = Kc - 1, inp = [state; x] ([P + T, C]):
//       y[t, c] = silu(sum_{j<Kc} w[c, j] * inp[t + j, c])        (cross-correlation, as MLX)
//       state <- the last P rows of inp
//   gated_delta_f32: per value head h (key head hk = h / (Hv / Hk)) and token t, on state S_h [dv, dk]:
//       S = g[t,h] * S;  delta = (v[t,h,:] - S k) * beta[t,h];  S = S + delta k^T;  out[t,h,:] = S q
//       with k = k[t,hk,:], q = q[t,hk,:] (q already carries the dk^-0.5 readout scale).
//
// Buffer layouts (f32, contiguous)
//   conv1d_step_f32:  0 x [T, C]   1 state [Kc-1, C] (read, then overwritten)   2 w [C, Kc]   3 y [T, C]
//                     4 T (uint)   5 C (uint)   6 Kc (uint, 1..CONV_MAX_K = 8)
//   gated_delta_f32:  0 q [T, Hk, dk]   1 k [T, Hk, dk]   2 v [T, Hv, dv]   3 g [T, Hv] (decay, already
//                     exp'd)   4 beta [T, Hv]   5 state [Hv, dv, dk] (read, then overwritten)
//                     6 out [T, Hv, dv]   7 T   8 Hk   9 Hv   10 dk (at most DELTA_MAX_DK = 256)   11 dv (uint)
//
// Launch geometry
//   conv1d_step_f32: grid = (ceil(C / 256), 1, 1), threadgroup = (256, 1, 1); one thread per channel
//       walks all T tokens with its Kc taps and a window of the last Kc inputs in registers, then writes
//       the channel's new state (no other thread touches that column, so in place is safe).
//   gated_delta_f32: grid = (ceil(dv / R), Hv, 1), threadgroup = (32, R, 1) with R = 4 simdgroups;
//       simdgroup sg of group (x, h) owns state row i = x * R + sg of head h. Each lane keeps the row's
//       elements d = lane + 32*e (e < 8) in registers across all T tokens; the two dot products per token
//       (S k and S q) are simd_sums. q and k rows are read by every simdgroup of the head straight from
//       device memory (each lane only its own dims; the rows are shared through the cache), and the state
//       row is written back once at the end.

#include <metal_stdlib>
using namespace metal;

enum { CONV_MAX_K = 8, DELTA_EPL = 8, DELTA_MAX_DK = 32 * DELTA_EPL };

inline float la_silu(float a)
{
    return a / (1.0f + metal::exp(-a));
}

kernel void conv1d_step_f32(device const float* x [[buffer(0)]],
                            device float* state [[buffer(1)]],
                            device const float* w [[buffer(2)]],
                            device float* y [[buffer(3)]],
                            constant uint& T [[buffer(4)]],
                            constant uint& C [[buffer(5)]],
                            constant uint& Kc [[buffer(6)]],
                            uint c [[thread_position_in_grid]])
{
    if (c < C) {
        uint P = Kc - 1;
        float wt[CONV_MAX_K];
        float win[CONV_MAX_K];  // win[0..P-1]: the last P inputs; win[P]: the current one
        for (uint j = 0; j < CONV_MAX_K; ++j) {
            wt[j] = j < Kc ? w[c * Kc + j] : 0.0f;
            win[j] = j < P ? state[j * C + c] : 0.0f;
        }
        for (uint t = 0; t < T; ++t) {
            float xt = x[t * C + c];
            float acc = 0.0f;
            for (uint j = 0; j < CONV_MAX_K; ++j) {
                if (j == P) {
                    win[j] = xt;
                }
                if (j < Kc) {
                    acc = fma(wt[j], win[j], acc);
                }
            }
            y[t * C + c] = la_silu(acc);
            for (uint j = 0; j + 1 < CONV_MAX_K; ++j) {  // slide: drop the oldest input
                win[j] = win[j + 1];
            }
        }
        for (uint j = 0; j < P; ++j) {
            state[j * C + c] = win[j];
        }
    }
}

kernel void gated_delta_f32(device const float* q [[buffer(0)]],
                            device const float* k [[buffer(1)]],
                            device const float* v [[buffer(2)]],
                            device const float* g [[buffer(3)]],
                            device const float* beta [[buffer(4)]],
                            device float* state [[buffer(5)]],
                            device float* out [[buffer(6)]],
                            constant uint& T [[buffer(7)]],
                            constant uint& Hk [[buffer(8)]],
                            constant uint& Hv [[buffer(9)]],
                            constant uint& dk [[buffer(10)]],
                            constant uint& dv [[buffer(11)]],
                            uint3 tg_pos [[threadgroup_position_in_grid]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint nsg [[simdgroups_per_threadgroup]])
{
    uint h = tg_pos.y;
    uint i = tg_pos.x * nsg + sg;  // state row (value dim); uniform within the simdgroup
    if (i < dv) {
        uint hk = h / (Hv / Hk);
        device float* srow = state + (h * dv + i) * dk;
        float s[DELTA_EPL];
        for (uint e = 0; e < DELTA_EPL; ++e) {
            uint d = lane + 32 * e;
            s[e] = d < dk ? srow[d] : 0.0f;
        }
        for (uint t = 0; t < T; ++t) {
            float gt = g[t * Hv + h];
            float bt = beta[t * Hv + h];
            device const float* kt = k + (t * Hk + hk) * dk;
            device const float* qt = q + (t * Hk + hk) * dk;
            float kd[DELTA_EPL];
            float kv = 0.0f;
            for (uint e = 0; e < DELTA_EPL; ++e) {
                uint d = lane + 32 * e;
                kd[e] = d < dk ? kt[d] : 0.0f;
                s[e] *= gt;
                kv = fma(s[e], kd[e], kv);
            }
            kv = simd_sum(kv);
            float delta = (v[(t * Hv + h) * dv + i] - kv) * bt;
            float o = 0.0f;
            for (uint e = 0; e < DELTA_EPL; ++e) {
                uint d = lane + 32 * e;
                s[e] = fma(kd[e], delta, s[e]);
                o = d < dk ? fma(s[e], qt[d], o) : o;
            }
            o = simd_sum(o);
            if (lane == 0) {
                out[(t * Hv + h) * dv + i] = o;
            }
        }
        for (uint e = 0; e < DELTA_EPL; ++e) {
            uint d = lane + 32 * e;
            if (d < dk) {
                srow[d] = s[e];
            }
        }
    }
}
