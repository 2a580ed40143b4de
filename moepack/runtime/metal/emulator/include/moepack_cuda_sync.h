// CUDA branch: simdgroup collectives as 32-lane warp shuffles with a full mask, barriers as
// __syncthreads. Metal simdgroups and CUDA warps are both 32 lanes; thread_index_in_simdgroup is the
// linear thread index mod 32 in both.
#ifndef MOEPACK_CUDA_SYNC_H
#define MOEPACK_CUDA_SYNC_H

namespace metal {
enum { moepack_shfl_idx = 0, moepack_shfl_up = 1, moepack_shfl_down = 2, moepack_shfl_bfly = 3 };
template <class T> MOEPACK_HD T moepack_shfl(T x, int mode, int arg) {
  enum { W = (sizeof(T) + 3) / 4 };
  int w[W];
  w[W - 1] = 0;
  __builtin_memcpy(w, &x, sizeof(T));
  for (int i = 0; i < W; ++i) {
    if (mode == moepack_shfl_idx) w[i] = __nvvm_shfl_sync_idx_i32(0xffffffffu, w[i], arg, 0x1f);
    else if (mode == moepack_shfl_up) w[i] = __nvvm_shfl_sync_up_i32(0xffffffffu, w[i], arg, 0);
    else if (mode == moepack_shfl_down) w[i] = __nvvm_shfl_sync_down_i32(0xffffffffu, w[i], arg, 0x1f);
    else w[i] = __nvvm_shfl_sync_bfly_i32(0xffffffffu, w[i], arg, 0x1f);
  }
  T r;
  __builtin_memcpy(&r, w, sizeof(T));
  return r;
}
MOEPACK_HD uint moepack_lane_id() { return (uint)__nvvm_read_ptx_sreg_laneid(); }

#define MOEPACK_CUDA_REDUCE(NAME, COMBINE)                                  \
  template <class T> MOEPACK_HD T NAME(int, int, T acc) {                   \
    for (int off = 16; off > 0; off >>= 1) {                                \
      T v = moepack_shfl(acc, moepack_shfl_bfly, off);                      \
      acc = COMBINE;                                                        \
    }                                                                       \
    return acc;                                                             \
  }
MOEPACK_CUDA_REDUCE(moepack_simd_sum, acc + v)
MOEPACK_CUDA_REDUCE(moepack_simd_product, acc * v)
MOEPACK_CUDA_REDUCE(moepack_simd_max, max(acc, v))
MOEPACK_CUDA_REDUCE(moepack_simd_min, min(acc, v))
MOEPACK_CUDA_REDUCE(moepack_simd_and, acc & v)
MOEPACK_CUDA_REDUCE(moepack_simd_or, acc | v)
MOEPACK_CUDA_REDUCE(moepack_simd_xor, acc ^ v)
#undef MOEPACK_CUDA_REDUCE
MOEPACK_HD bool moepack_simd_all(int, int, bool b) { return __nvvm_vote_all_sync(0xffffffffu, b); }
MOEPACK_HD bool moepack_simd_any(int, int, bool b) { return __nvvm_vote_any_sync(0xffffffffu, b); }
template <class T, class I> MOEPACK_HD T moepack_simd_shuffle(int, int, T x, I lane) { return moepack_shfl(x, moepack_shfl_idx, (int)lane); }
template <class T, class I> MOEPACK_HD T moepack_simd_broadcast(int, int, T x, I lane) { return moepack_shfl(x, moepack_shfl_idx, (int)lane); }
template <class T, class I> MOEPACK_HD T moepack_simd_shuffle_xor(int, int, T x, I m) { return moepack_shfl(x, moepack_shfl_bfly, (int)m); }
template <class T, class I> MOEPACK_HD T moepack_simd_shuffle_down(int, int, T x, I d) { return moepack_shfl(x, moepack_shfl_down, (int)d); }
template <class T, class I> MOEPACK_HD T moepack_simd_shuffle_up(int, int, T x, I d) { return moepack_shfl(x, moepack_shfl_up, (int)d); }
template <class T> MOEPACK_HD T moepack_simd_broadcast_first(int, int, T x) { return moepack_shfl(x, moepack_shfl_idx, 0); }
template <class T> MOEPACK_HD T moepack_simd_prefix_inclusive_sum(int, int, T x) {
  uint lane = moepack_lane_id();
  for (int d = 1; d < 32; d <<= 1) {
    T y = moepack_shfl(x, moepack_shfl_up, d);
    if (lane >= (uint)d) x = x + y;
  }
  return x;
}
template <class T> MOEPACK_HD T moepack_simd_prefix_exclusive_sum(int l, int s, T x) {
  T inc = moepack_simd_prefix_inclusive_sum(l, s, x);
  T prev = moepack_shfl(inc, moepack_shfl_up, 1);
  return moepack_lane_id() == 0 ? x - x : prev;
}
MOEPACK_HD void moepack_threadgroup_barrier(int, int, mem_flags = mem_flags::mem_none) { __syncthreads(); }
MOEPACK_HD void moepack_simdgroup_barrier(int, int, mem_flags = mem_flags::mem_none) { __nvvm_bar_warp_sync(0xffffffffu); }
}  // namespace metal

#endif
