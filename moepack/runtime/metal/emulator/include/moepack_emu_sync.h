// CPU emulator: simdgroup collectives and barriers as calls into the fiber scheduler
// (moepack_emu_runtime.h, compiled into the same translation unit by the generated glue).
// Included by <metal_stdlib>; kernel code reaches these through the simd_* / *_barrier macros.
#ifndef MOEPACK_EMU_SYNC_H
#define MOEPACK_EMU_SYNC_H

namespace moepack_emu {
enum { SLOT = 64, LANES = 32 };
enum Op {
  OP_SUM = 1, OP_PRODUCT, OP_MAX, OP_MIN, OP_AND, OP_OR, OP_XOR, OP_ALL, OP_ANY, OP_SHUFFLE,
  OP_SHUFFLE_XOR, OP_SHUFFLE_DOWN, OP_SHUFFLE_UP, OP_BROADCAST, OP_BROADCAST_FIRST, OP_PREFIX_EXCL,
  OP_PREFIX_INCL, OP_SIMD_BARRIER
};
// What a lane sees after a collective is released: every active lane's value as it was at release.
struct Snapshot {
  const unsigned char* vals;  // LANES slots of SLOT bytes
  unsigned mask;              // active lanes
  unsigned lane;              // the calling lane
};
static Snapshot collective(int line, int site, int op, const void* value, unsigned size);
static void barrier(int line, int site, unsigned flags);
static void* tg_alloc(unsigned long size, unsigned long align, int id);

template <class T> inline T lane_value(const Snapshot& s, unsigned lane) {
  T v;
  __builtin_memcpy(&v, s.vals + lane * SLOT, sizeof(T));
  return v;
}
template <class T> inline T poison() {
  T v;
  __builtin_memset(&v, 0xff, sizeof(T));
  return v;
}
}  // namespace moepack_emu

namespace metal {
#define MOEPACK_EMU_COLLECT(OP)                                                        \
  static_assert(sizeof(T) <= moepack_emu::SLOT, "simd collective: value too large");   \
  moepack_emu::Snapshot s = moepack_emu::collective(line, site, OP, &x, sizeof(T))

#define MOEPACK_EMU_REDUCE(NAME, OP, COMBINE)                                          \
  template <class T> inline T NAME(int line, int site, T x) {                          \
    MOEPACK_EMU_COLLECT(OP);                                                           \
    bool first = true;                                                                 \
    T acc = x;                                                                         \
    for (unsigned l = 0; l < moepack_emu::LANES; ++l) {                                \
      if (!(s.mask >> l & 1u)) continue;                                               \
      T v = moepack_emu::lane_value<T>(s, l);                                          \
      if (first) { acc = v; first = false; } else { acc = COMBINE; }                   \
    }                                                                                  \
    return acc;                                                                        \
  }
MOEPACK_EMU_REDUCE(moepack_simd_sum, moepack_emu::OP_SUM, acc + v)
MOEPACK_EMU_REDUCE(moepack_simd_product, moepack_emu::OP_PRODUCT, acc * v)
MOEPACK_EMU_REDUCE(moepack_simd_max, moepack_emu::OP_MAX, max(acc, v))
MOEPACK_EMU_REDUCE(moepack_simd_min, moepack_emu::OP_MIN, min(acc, v))
MOEPACK_EMU_REDUCE(moepack_simd_and, moepack_emu::OP_AND, acc & v)
MOEPACK_EMU_REDUCE(moepack_simd_or, moepack_emu::OP_OR, acc | v)
MOEPACK_EMU_REDUCE(moepack_simd_xor, moepack_emu::OP_XOR, acc ^ v)
#undef MOEPACK_EMU_REDUCE

inline bool moepack_simd_all(int line, int site, bool b) {
  int x = b;
  moepack_emu::Snapshot s = moepack_emu::collective(line, site, moepack_emu::OP_ALL, &x, sizeof x);
  for (unsigned l = 0; l < moepack_emu::LANES; ++l)
    if ((s.mask >> l & 1u) && !moepack_emu::lane_value<int>(s, l)) return false;
  return true;
}
inline bool moepack_simd_any(int line, int site, bool b) {
  int x = b;
  moepack_emu::Snapshot s = moepack_emu::collective(line, site, moepack_emu::OP_ANY, &x, sizeof x);
  for (unsigned l = 0; l < moepack_emu::LANES; ++l)
    if ((s.mask >> l & 1u) && moepack_emu::lane_value<int>(s, l)) return true;
  return false;
}

// Reading an inactive lane is undefined in Metal: the emulator returns an all-ones (NaN) pattern.
template <class T> inline T moepack_emu_read(const moepack_emu::Snapshot& s, unsigned src) {
  if (src < moepack_emu::LANES && (s.mask >> src & 1u)) return moepack_emu::lane_value<T>(s, src);
  return moepack_emu::poison<T>();
}
template <class T, class I> inline T moepack_simd_shuffle(int line, int site, T x, I lane) {
  MOEPACK_EMU_COLLECT(moepack_emu::OP_SHUFFLE);
  return moepack_emu_read<T>(s, (unsigned)lane);
}
template <class T, class I> inline T moepack_simd_broadcast(int line, int site, T x, I lane) {
  MOEPACK_EMU_COLLECT(moepack_emu::OP_BROADCAST);
  return moepack_emu_read<T>(s, (unsigned)lane);
}
template <class T, class I> inline T moepack_simd_shuffle_xor(int line, int site, T x, I mask) {
  MOEPACK_EMU_COLLECT(moepack_emu::OP_SHUFFLE_XOR);
  return moepack_emu_read<T>(s, s.lane ^ (unsigned)mask);
}
template <class T, class I> inline T moepack_simd_shuffle_down(int line, int site, T x, I delta) {
  MOEPACK_EMU_COLLECT(moepack_emu::OP_SHUFFLE_DOWN);
  unsigned src = s.lane + (unsigned)delta;
  return src >= moepack_emu::LANES ? x : moepack_emu_read<T>(s, src);
}
template <class T, class I> inline T moepack_simd_shuffle_up(int line, int site, T x, I delta) {
  MOEPACK_EMU_COLLECT(moepack_emu::OP_SHUFFLE_UP);
  return (unsigned)delta > s.lane ? x : moepack_emu_read<T>(s, s.lane - (unsigned)delta);
}
template <class T> inline T moepack_simd_broadcast_first(int line, int site, T x) {
  MOEPACK_EMU_COLLECT(moepack_emu::OP_BROADCAST_FIRST);
  return moepack_emu::lane_value<T>(s, (unsigned)__builtin_ctz(s.mask));
}
template <class T> inline T moepack_simd_prefix_exclusive_sum(int line, int site, T x) {
  MOEPACK_EMU_COLLECT(moepack_emu::OP_PREFIX_EXCL);
  T acc = x - x;
  for (unsigned l = 0; l < s.lane; ++l)
    if (s.mask >> l & 1u) acc = acc + moepack_emu::lane_value<T>(s, l);
  return acc;
}
template <class T> inline T moepack_simd_prefix_inclusive_sum(int line, int site, T x) {
  MOEPACK_EMU_COLLECT(moepack_emu::OP_PREFIX_INCL);
  T acc = x - x;
  for (unsigned l = 0; l <= s.lane; ++l)
    if (s.mask >> l & 1u) acc = acc + moepack_emu::lane_value<T>(s, l);
  return acc;
}
#undef MOEPACK_EMU_COLLECT

inline void moepack_threadgroup_barrier(int line, int site, mem_flags f) { moepack_emu::barrier(line, site, (uint)f); }
inline void moepack_threadgroup_barrier(int line, int site) { moepack_emu::barrier(line, site, 0); }
inline void moepack_simdgroup_barrier(int line, int site, mem_flags = mem_flags::mem_none) {
  int x = 0;
  moepack_emu::collective(line, site, moepack_emu::OP_SIMD_BARRIER, &x, 0);
}
}  // namespace metal

#endif
