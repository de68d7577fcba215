// How the pipelined algorithm moves bytes: every copy of its schedule (x into
// the published slot, peer pulls, local rows) and time_copy's goes through
// here, on the path initialize() verified for the GPU, split at kMaxCopyBytes.
//
// The paths, in the order initialize() tries them (runtime.cc
// choose_copy_path), each verified on every peer pair by a pattern copy
// checked on the GPU that pulled it; the first whose bytes land from every
// peer (this GPU's own workspace included, for the local copies) is the
// GPU's path, and no call runs on a path that was not verified:
//   kEngine          the copy engine (gpu.h kEngineCopyKind: SDMA on AMD).
//                    On ROCm a peer copy with hipMemcpyDeviceToDeviceNoCU
//                    can leave the destination unwritten with no error when
//                    the engine picked cannot serve it (ROCm/rocm-systems
//                    #11318), and MI308X advertises SDMA engines that are
//                    fused off (ROCm/mori #693).
//   kDeviceToDevice  a plain device-to-device copy (gpu.h kPlainCopyKind).
//   kKernel          kernels/copy_kernels.h launch_copy_2d on a few SMs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "platform/status.h"

namespace jo::pipelined {

enum class CopyPath : int { kEngine = 0, kDeviceToDevice = 1, kKernel = 2 };
inline constexpr CopyPath kCopyPaths[] = {CopyPath::kEngine, CopyPath::kDeviceToDevice, CopyPath::kKernel};

// "copy_engine", "device_to_device", "kernel" (what Python sees), and with the copy kind, for messages.
const char* copy_path_name(CopyPath path);
std::string describe_copy_path(CopyPath path);
bool parse_copy_path(const std::string& name, CopyPath* out);

// No single copy moves more: one SDMA copy of 256 MiB or more can stall the
// engine and hang on 8x MI355X, where capping copies at 128 MiB cost no
// bandwidth (ROCm/rocm-systems #9927). On the H200, benchmarks/bench_copy_split.py
// times 256 MiB to 2 GiB as one copy against 128 MiB pieces.
inline constexpr uint64_t kMaxCopyBytes = uint64_t{128} << 20;
// The cap in force: kMaxCopyBytes, or lower under the fault copy_max_bytes=N (copy.cc).
uint64_t max_copy_bytes();

// One piece of a split copy: rows [row, row + height) of bytes [offset, offset + width) of each.
struct CopyPiece {
  uint64_t row, offset, width, height;
};
// The pieces copy_2d enqueues for `height` rows of `width` bytes, each of at
// most `max_bytes` (rounded down to whole 16-byte vectors, at least one):
// whole rows together while they fit, else each row in pieces.
std::vector<CopyPiece> copy_pieces(uint64_t width, uint64_t height, uint64_t max_bytes);

// Enqueues on `stream` `height` rows of `width` bytes, row i from
// src + i * src_pitch to dst + i * dst_pitch, on `path`, in pieces of at most
// `max_bytes`.
Status copy_2d(CopyPath path, void* dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch, uint64_t width,
               uint64_t height, hipStream_t stream, uint64_t max_bytes);
inline Status copy_bytes(CopyPath path, void* dst, const void* src, uint64_t bytes, hipStream_t stream) {
  return copy_2d(path, dst, bytes, src, bytes, bytes, 1, stream, max_copy_bytes());
}
// `rows` rows of `cols` elements of `elem_bytes` per batch element, batch strides in elements.
Status copy_rows(CopyPath path, char* dst, int64_t dst_batch_stride, const char* src, int64_t src_batch_stride,
                 int64_t batch, int64_t rows, int64_t cols, int elem_bytes, hipStream_t stream);

// The self-test. Each workspace holds, just before its regions, kCopyCheckBytes
// of a pattern its owner wrote (fill_copy_pattern, seeded by the owner's
// global device id) before anyone could map it; a peer's is at its mapped
// region base minus kCopyCheckBytes.
inline constexpr uint64_t kCopyCheckBytes = uint64_t{64} << 10;
// Device scratch check_copy_path needs.
inline constexpr uint64_t kCopyCheckScratchBytes = kCopyCheckBytes + 256;
hipError_t fill_copy_pattern(void* area, int64_t owner, hipStream_t stream);
// Copies `owner`'s pattern (as mapped here) into `scratch` on `path` the ways
// the schedule copies (one contiguous copy; rows with different pitches, as a
// batched pull), checks the result on the GPU and waits for it: the number of
// 32-bit words that are not what they should be (0: the path works). The wait
// is bounded by `timeout_seconds` (the GPU's watchdog): past it, *stalled is
// set (a copy engine that never finishes, as fused-off SDMA engines of MI308X
// do, ROCm/mori #693) and the work is still queued on `stream`: `scratch` and
// `stream` must then be left alone, not freed or waited for.
Status check_copy_path(CopyPath path, const char* pattern, int64_t owner, char* scratch, hipStream_t stream,
                       double timeout_seconds, uint64_t* wrong_words, bool* stalled);

}  // namespace jo::pipelined
