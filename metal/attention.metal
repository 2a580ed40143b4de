// attention.metal: causal grouped-query attention of T query tokens over the whole KV cache (decode and
// small prefill chunks), f32. One pass with a threadgroup per (query head, token), or, for long caches
// and few heads x tokens, two passes that also split the keys across threadgroups ("split-K").
//
// What the kernels compute (spec: moepack/runtime/kernels_ref.py attention)
//   for token t at position p = pos[t], query head h, kv head g = h / (Hq / Hkv):
//       s_j = dot(q[t,h,:] * scale, k[j,g,:])            for keys j = 0..p (key j has position j)
//       out[t,h,:] = sum_j softmax(s)_j * v[j,g,:]
//   attention_f32        one pass: out directly.
//   attention_split_f32  pass 1: threadgroup (h, t, c) takes keys [c*chunk, (c+1)*chunk) and writes its
//                        partial softmax: m = max s_j, l = sum exp(s_j - m), o = sum exp(s_j - m) v_j
//                        (m = -inf, l = 0, o = 0 where the chunk holds no visible key).
//   attention_merge_f32  pass 2: out = sum_c o_c exp(m_c - M) / sum_c l_c exp(m_c - M), M = max_c m_c.
//
// Buffer layouts (f32, contiguous)
//   attention_f32:        0 q [T, Hq, hd]   1 k [S, Hkv, hd]   2 v [S, Hkv, hd]   3 pos [T] (int)
//                         4 out [T, Hq, hd]   5 Hq (uint)   6 Hkv (uint)   7 hd (uint, <= ATT_MAX_HD = 256)
//                         8 S (uint)   9 scale (float)
//   attention_split_f32:  0-3 as above   4 part_m [T, Hq, n]   5 part_l [T, Hq, n]   6 part_o [T, Hq, n, hd]
//                         7 Hq   8 Hkv   9 hd   10 S   11 scale   12 chunk (uint, keys per split)
//   attention_merge_f32:  0 part_m   1 part_l   2 part_o (as written by pass 1)   3 out [T, Hq, hd]
//                         4 Hq (uint)   5 hd (uint)   6 n (uint, splits, <= ATT_MAX_SPLIT = 32)
//   Keys past min(pos[t] + 1, S) are never read.
//
// Launch geometry
//   attention_f32:        grid (Hq, T, 1)      threadgroup (32 * nsg, 1, 1), 1 <= nsg <= ATT_MAX_SG (8)
//   attention_split_f32:  grid (Hq, T, n)      threadgroup (32 * nsg, 1, 1)
//   attention_merge_f32:  grid (Hq, T, 1)      threadgroup (tpg, 1, 1), any tpg (threads stride over hd)
//   ops_seq picks nsg = clamp(ceil(keys per threadgroup / 32), 1, 8), and the split path when V >= 1024
//   visible keys (V = max pos + 1) would otherwise run on fewer than 256 threadgroups: n = min(32,
//   ceil(V / 512)) splits of chunk = ceil(V / n) keys.
//   In a threadgroup, simdgroup sg takes keys j0 + sg, j0 + sg + nsg, ... Each lane holds the query dims
//   d = lane + 32*e (e < 8) in registers, already scaled; the dot product of one key is a simd_sum, and the
//   simdgroup keeps a running (max m, sum l, output o) online softmax, o again in registers. At the end
//   every simdgroup puts (m, l, o) into threadgroup memory and, after one barrier, the threads merge the
//   nsg partial softmaxes as pass 2 merges the splits. Adjacent lanes read adjacent floats of each key
//   and value row (coalesced).

#include <metal_stdlib>
using namespace metal;

enum { ATT_MAX_SG = 8, ATT_EPL = 8, ATT_MAX_HD = 32 * ATT_EPL, ATT_MAX_SPLIT = 32 };

// The online softmax of one query row over keys [j0, j1), merged across the threadgroup's simdgroups.
// On return every thread holds the merged max (*m_out), sum (*l_out) and the merge weights f[i] of the
// simdgroups, and part_o holds each simdgroup's output row: o = sum_i part_o[i*hd + d] * f[i].
// Contains one barrier: every thread of the group must call it.
inline void attention_span(device const float* qr, device const float* k, device const float* v, uint row,
                           uint hd, float scale, uint j0, uint j1, uint lane, uint sg, uint nsg,
                           threadgroup float* part_m, threadgroup float* part_l, threadgroup float* part_o,
                           thread float* f, thread float* m_out, thread float* l_out)
{
    float qv[ATT_EPL];
    float o[ATT_EPL];
    for (uint e = 0; e < ATT_EPL; ++e) {
        uint d = lane + 32 * e;
        qv[e] = d < hd ? qr[d] * scale : 0.0f;
        o[e] = 0.0f;
    }

    float m = -INFINITY;  // running max of this simdgroup's scores
    float l = 0.0f;       // running sum of exp(s - m)
    for (uint j = j0 + sg; j < j1; j += nsg) {  // uniform within the simdgroup
        device const float* kr = k + j * row;
        float s = 0.0f;
        for (uint e = 0; e < ATT_EPL; ++e) {
            uint d = lane + 32 * e;
            if (d < hd) {
                s = fma(qv[e], kr[d], s);
            }
        }
        s = simd_sum(s);
        float m_new = max(m, s);
        float corr = metal::exp(m - m_new);  // exp(-inf) = 0 on the first key
        float pj = metal::exp(s - m_new);
        l = fma(l, corr, pj);
        device const float* vr = v + j * row;
        for (uint e = 0; e < ATT_EPL; ++e) {
            uint d = lane + 32 * e;
            if (d < hd) {
                o[e] = fma(o[e], corr, pj * vr[d]);
            }
        }
        m = m_new;
    }

    for (uint e = 0; e < ATT_EPL; ++e) {
        uint d = lane + 32 * e;
        if (d < hd) {
            part_o[sg * hd + d] = o[e];
        }
    }
    if (lane == 0) {
        part_m[sg] = m;
        part_l[sg] = l;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // simdgroups that saw no key (m = -inf) weigh 0; with no key at all m = -inf, l = 0
    float big = -INFINITY;
    for (uint i = 0; i < nsg; ++i) {
        big = max(big, part_m[i]);
    }
    float total = 0.0f;
    for (uint i = 0; i < ATT_MAX_SG; ++i) {
        f[i] = (i < nsg && part_m[i] > -INFINITY) ? metal::exp(part_m[i] - big) : 0.0f;
        total = i < nsg ? fma(part_l[i], f[i], total) : total;
    }
    *m_out = big;
    *l_out = total;
}

inline uint attention_visible(device const int* pos, uint t, uint S)
{
    int last = pos[t];
    return last < 0 ? 0u : min(uint(last) + 1u, S);
}

kernel void attention_f32(device const float* q [[buffer(0)]],
                          device const float* k [[buffer(1)]],
                          device const float* v [[buffer(2)]],
                          device const int* pos [[buffer(3)]],
                          device float* out [[buffer(4)]],
                          constant uint& Hq [[buffer(5)]],
                          constant uint& Hkv [[buffer(6)]],
                          constant uint& hd [[buffer(7)]],
                          constant uint& S [[buffer(8)]],
                          constant float& scale [[buffer(9)]],
                          uint3 tg_pos [[threadgroup_position_in_grid]],
                          uint3 tpg3 [[threads_per_threadgroup]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint nsg [[simdgroups_per_threadgroup]])
{
    threadgroup float part_m[ATT_MAX_SG];
    threadgroup float part_l[ATT_MAX_SG];
    threadgroup float part_o[ATT_MAX_SG * ATT_MAX_HD];

    uint h = tg_pos.x;
    uint t = tg_pos.y;
    uint g = h / (Hq / Hkv);
    uint n_keys = attention_visible(pos, t, S);
    float f[ATT_MAX_SG];
    float m, l;
    attention_span(q + (t * Hq + h) * hd, k + g * hd, v + g * hd, Hkv * hd, hd, scale, 0, n_keys, lane, sg, nsg,
                   part_m, part_l, part_o, f, &m, &l);
    float inv = n_keys > 0 ? 1.0f / l : 0.0f;
    device float* orow = out + (t * Hq + h) * hd;
    for (uint d = tid; d < hd; d += tpg3.x) {
        float acc = 0.0f;
        for (uint i = 0; i < nsg; ++i) {
            acc = fma(part_o[i * hd + d], f[i], acc);
        }
        orow[d] = acc * inv;
    }
}

kernel void attention_split_f32(device const float* q [[buffer(0)]],
                                device const float* k [[buffer(1)]],
                                device const float* v [[buffer(2)]],
                                device const int* pos [[buffer(3)]],
                                device float* out_m [[buffer(4)]],
                                device float* out_l [[buffer(5)]],
                                device float* out_o [[buffer(6)]],
                                constant uint& Hq [[buffer(7)]],
                                constant uint& Hkv [[buffer(8)]],
                                constant uint& hd [[buffer(9)]],
                                constant uint& S [[buffer(10)]],
                                constant float& scale [[buffer(11)]],
                                constant uint& chunk [[buffer(12)]],
                                uint3 tg_pos [[threadgroup_position_in_grid]],
                                uint3 tpg3 [[threads_per_threadgroup]],
                                uint3 ngroups [[threadgroups_per_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint nsg [[simdgroups_per_threadgroup]])
{
    threadgroup float part_m[ATT_MAX_SG];
    threadgroup float part_l[ATT_MAX_SG];
    threadgroup float part_o[ATT_MAX_SG * ATT_MAX_HD];

    uint h = tg_pos.x;
    uint t = tg_pos.y;
    uint c = tg_pos.z;
    uint n = ngroups.z;
    uint g = h / (Hq / Hkv);
    uint n_keys = attention_visible(pos, t, S);
    uint j0 = min(c * chunk, n_keys);
    uint j1 = min(j0 + chunk, n_keys);
    float f[ATT_MAX_SG];
    float m, l;
    attention_span(q + (t * Hq + h) * hd, k + g * hd, v + g * hd, Hkv * hd, hd, scale, j0, j1, lane, sg, nsg,
                   part_m, part_l, part_o, f, &m, &l);
    uint slot = (t * Hq + h) * n + c;
    if (tid == 0) {
        out_m[slot] = m;
        out_l[slot] = l;
    }
    device float* orow = out_o + slot * hd;
    for (uint d = tid; d < hd; d += tpg3.x) {
        float acc = 0.0f;
        for (uint i = 0; i < nsg; ++i) {
            acc = fma(part_o[i * hd + d], f[i], acc);
        }
        orow[d] = acc;
    }
}

kernel void attention_merge_f32(device const float* part_m [[buffer(0)]],
                                device const float* part_l [[buffer(1)]],
                                device const float* part_o [[buffer(2)]],
                                device float* out [[buffer(3)]],
                                constant uint& Hq [[buffer(4)]],
                                constant uint& hd [[buffer(5)]],
                                constant uint& n [[buffer(6)]],
                                uint3 tg_pos [[threadgroup_position_in_grid]],
                                uint3 tpg3 [[threads_per_threadgroup]],
                                uint tid [[thread_index_in_threadgroup]])
{
    uint h = tg_pos.x;
    uint t = tg_pos.y;
    uint base = (t * Hq + h) * n;
    float big = -INFINITY;
    for (uint c = 0; c < n; ++c) {
        big = max(big, part_m[base + c]);
    }
    float f[ATT_MAX_SPLIT];
    float total = 0.0f;
    for (uint c = 0; c < ATT_MAX_SPLIT; ++c) {
        f[c] = (c < n && part_m[base + c] > -INFINITY) ? metal::exp(part_m[base + c] - big) : 0.0f;
        total = c < n ? fma(part_l[base + c], f[c], total) : total;
    }
    float inv = total > 0.0f ? 1.0f / total : 0.0f;
    device float* orow = out + (t * Hq + h) * hd;
    for (uint d = tid; d < hd; d += tpg3.x) {
        float acc = 0.0f;
        for (uint c = 0; c < n; ++c) {
            acc = fma(part_o[(base + c) * hd + d], f[c], acc);
        }
        orow[d] = acc * inv;
    }
}
