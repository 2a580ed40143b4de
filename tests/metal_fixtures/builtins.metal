// Test fixture: every builtin attribute, written per thread. out: [threads in grid * 24] uint, one row of
// 24 per thread at its linear grid index. Any grid / threadgroup geometry.
#include <metal_stdlib>
using namespace metal;

kernel void builtins(device uint* out [[buffer(0)]],
                     uint3 tpig [[thread_position_in_grid]],
                     uint3 tpitg [[thread_position_in_threadgroup]],
                     uint3 tgpig [[threadgroup_position_in_grid]],
                     uint3 tptg [[threads_per_threadgroup]],
                     uint3 tgpg [[threadgroups_per_grid]],
                     uint3 tpg [[threads_per_grid]],
                     uint tiitg [[thread_index_in_threadgroup]],
                     ushort tiisg [[thread_index_in_simdgroup]],
                     uint sgitg [[simdgroup_index_in_threadgroup]],
                     uint sgptg [[simdgroups_per_threadgroup]],
                     ushort2 tpig2 [[thread_position_in_grid]],
                     uint width [[thread_execution_width]]) {
  device uint* o = out + 24 * (tpig.x + tpg.x * (tpig.y + tpg.y * tpig.z));
  o[0] = tpig.x; o[1] = tpig.y; o[2] = tpig.z;
  o[3] = tpitg.x; o[4] = tpitg.y; o[5] = tpitg.z;
  o[6] = tgpig.x; o[7] = tgpig.y; o[8] = tgpig.z;
  o[9] = tptg.x; o[10] = tptg.y; o[11] = tptg.z;
  o[12] = tgpg.x; o[13] = tgpg.y; o[14] = tgpg.z;
  o[15] = tpg.x; o[16] = tpg.y; o[17] = tpg.z;
  o[18] = tiitg; o[19] = tiisg; o[20] = sgitg; o[21] = sgptg;
  o[22] = uint(tpig2.x) + 1000u * uint(tpig2.y);
  o[23] = width;
}
