// router.metal: Qwen-style MoE routing, softmax over all E experts then the k most probable, optionally
// renormalised; one simdgroup per token.
//
// What the kernel computes (spec: moepack/runtime/kernels_ref.py router_topk)
//   p[e] = exp(l[e] - max l) / sum_e' exp(l[e'] - max l)            (float32)
//   idx[t, :] = the k experts of highest p, highest first; equal p go to the lower expert index
//   w[t, r] = p[idx[t, r]], divided by sum_r p[idx[t, r]] when norm != 0
//   The order is decided on the final p values (after the division), as the reference's stable argsort,
//   so the indices match it exactly, ties included.
//
// Buffer layouts
//   0 logits f32 [T, E]   1 idx int32 [T, k]   2 w f32 [T, k]
//   3 T (uint)   4 E (uint, at most ROUTER_MAX_E = 1024)   5 k (uint, 1 <= k <= min(E, 32))
//   6 norm (uint, 0 or 1)
//
// Launch geometry
//   grid        = (ceil(T / R), 1, 1)
//   threadgroup = (32, R, 1)           R simdgroups (ops_seq: R = min(4, T)), simdgroup sg of group x
//                                      routes token x * R + sg; no threadgroup memory, no barriers.
//   Lane l holds p for experts l, l + 32, l + 64, ... (at most 32) in registers. Max and sum are
//   simd_max / simd_sum; each of the k rounds takes every lane's best untaken expert and reduces the
//   (p, index) pairs with a simd_shuffle_xor butterfly under the order "larger p, then lower index" (a
//   total order, so every lane ends with the same winner), then marks the winner taken (p = -1 < any p).
//   Lane r keeps round r's winner and lanes r < k write the results.

#include <metal_stdlib>
using namespace metal;

enum { ROUTER_PER_LANE = 32, ROUTER_MAX_E = 32 * ROUTER_PER_LANE, ROUTER_MAX_K = 32 };

kernel void router_topk_f32(device const float* logits [[buffer(0)]],
                            device int* idx [[buffer(1)]],
                            device float* w [[buffer(2)]],
                            constant uint& T [[buffer(3)]],
                            constant uint& E [[buffer(4)]],
                            constant uint& k [[buffer(5)]],
                            constant uint& norm [[buffer(6)]],
                            uint3 tg_pos [[threadgroup_position_in_grid]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint nsg [[simdgroups_per_threadgroup]])
{
    uint t = tg_pos.x * nsg + sg;  // uniform within the simdgroup
    if (t < T) {
        device const float* lt = logits + t * E;
        float p[ROUTER_PER_LANE];
        float mx = -INFINITY;
        for (uint j = 0; j < ROUTER_PER_LANE; ++j) {
            uint e = lane + 32 * j;
            p[j] = e < E ? lt[e] : -INFINITY;
            mx = max(mx, p[j]);
        }
        mx = simd_max(mx);
        float sum = 0.0f;
        for (uint j = 0; j < ROUTER_PER_LANE; ++j) {
            uint e = lane + 32 * j;
            p[j] = e < E ? metal::exp(p[j] - mx) : 0.0f;
            sum += p[j];
        }
        sum = simd_sum(sum);
        for (uint j = 0; j < ROUTER_PER_LANE; ++j) {
            uint e = lane + 32 * j;
            p[j] = e < E ? p[j] / sum : -INFINITY;  // padding never wins
        }

        int my_idx = 0;
        float my_w = 0.0f;
        float total = 0.0f;
        for (uint r = 0; r < k; ++r) {
            // this lane's best: scanning upwards and replacing only on strictly larger keeps the lowest index
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            for (uint j = 0; j < ROUTER_PER_LANE; ++j) {
                if (p[j] > bv) {
                    bv = p[j];
                    bi = int(lane + 32 * j);
                }
            }
            for (uint off = 16; off > 0; off >>= 1) {
                float ov = simd_shuffle_xor(bv, ushort(off));
                int oi = simd_shuffle_xor(bi, ushort(off));
                if (ov > bv || (ov == bv && oi < bi)) {
                    bv = ov;
                    bi = oi;
                }
            }
            for (uint j = 0; j < ROUTER_PER_LANE; ++j) {
                if (int(lane + 32 * j) == bi) {
                    p[j] = -1.0f;
                }
            }
            if (lane == r) {
                my_idx = bi;
                my_w = bv;
            }
            total += bv;
        }
        if (lane < k) {
            idx[t * k + lane] = my_idx;
            w[t * k + lane] = norm != 0 ? my_w / total : my_w;
        }
    }
}
