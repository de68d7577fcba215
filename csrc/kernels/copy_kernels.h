// Device work of the pipelined algorithm's copy paths (pipelined/copy.h): the
// copy kernel, the path of last resort when no copy engine moves a peer's
// bytes right, and the pattern of initialize()'s copy self-test, written by
// each workspace's owner and checked on the GPU that pulled it.
#pragma once

#include <cstdint>

#include "platform/gpu.h"

namespace jo {

// `height` rows of `width` bytes, row i from src + i * src_pitch to
// dst + i * dst_pitch (a batched row copy of the schedule: one row per batch
// element), on a few workgroups (kernels/copy_kernels.cu kCopyWorkgroups).
// Any sizes and alignments: 16-byte moves when both addresses, both pitches
// and the width are multiples of 16 (every copy the schedule makes), single
// bytes otherwise.
hipError_t launch_copy_2d(void* dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch, uint64_t width,
                          uint64_t height, hipStream_t stream);

// Fills `bytes` (a multiple of 4) with the self-test pattern of workspace
// owner `seed`: word i is a hash of (seed, i), always odd.
hipError_t launch_fill_pattern(void* area, uint64_t bytes, uint32_t seed, hipStream_t stream);

// What a copy of pattern bytes should have left in `dst` (every field a
// multiple of 4 bytes): `height` rows of `width` bytes, row i the pattern of
// owner `seed` from byte src_offset + i * src_pitch; every other byte of
// [dst, dst + span) keeps the poison the check wrote before the copy (a byte
// of kPatternPoison: its words are even, so no pattern word equals them).
struct PatternCheck {
  const void* dst;
  uint64_t span;
  uint64_t dst_pitch, width, height;
  uint64_t src_offset, src_pitch;
  uint32_t seed;
};
inline constexpr int kPatternPoison = 0xA4;

// Adds to *wrong_words (device memory) the number of words of the check's
// span that differ from what it says.
hipError_t launch_check_pattern(const PatternCheck& check, uint32_t* wrong_words, hipStream_t stream);

}  // namespace jo
