#include "pipelined/copy.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "kernels/copy_kernels.h"
#include "runtime/faults.h"

namespace jo::pipelined {
namespace {

// The copy engine's path leaves the compute units free, or the build has none: jax_overlap/runtime/workspace.py
// _copies_on_sms takes "copy_engine" on AMD to mean SDMA, and plans the GEMMs on every CU. On ROCm only
// hipMemcpyDeviceToDeviceNoCU is SDMA for sure: a plain device-to-device copy may run as a blit kernel on the CUs
// (rocm-systems #11450), hipMemcpyBatchAsync's device-to-device copies run a shader on them (ROCm/llvm-project
// #2556) and hipStreamBatchMemOp a blit kernel (rocm-systems #2633), so none of them may stand in for it. HIP
// headers without the NoCU kind (ROCm < 6.2) leave this path out: the self-test refuses it and the GPU takes the
// plain device-to-device path, which Python counts as running on the CUs.
#if JO_PLATFORM_HIP
constexpr bool kEngineLeavesCusFree = HIP_VERSION >= 60200000;
#else
constexpr bool kEngineLeavesCusFree = true;
#endif
#if JO_PLATFORM_HIP && HIP_VERSION >= 60200000
static_assert(gpu::kEngineCopyKind == hipMemcpyDeviceToDeviceNoCU, "the copy engine's path is SDMA on AMD");
#endif

Status engine_path_refused() {
  return Status{std::string("jax_overlap: this build has no SDMA copy (its HIP headers lack ") +
                "hipMemcpyDeviceToDeviceNoCU, ROCm >= 6.2): the copy engine's path would run on the compute units"};
}

// One piece, at most the cap, on `path`.
Status enqueue_piece(CopyPath path, char* dst, uint64_t dst_pitch, const char* src, uint64_t src_pitch,
                     uint64_t width, uint64_t height, hipStream_t stream) {
  if (path == CopyPath::kKernel) {
    JO_RETURN_IF_HIP_ERROR(launch_copy_2d(dst, dst_pitch, src, src_pitch, width, height, stream));
    return {};
  }
  if (path == CopyPath::kEngine && !kEngineLeavesCusFree) return engine_path_refused();
  const auto kind = path == CopyPath::kEngine ? gpu::kEngineCopyKind : gpu::kPlainCopyKind;
  if (height == 1) {
    JO_RETURN_IF_HIP_ERROR(hipMemcpyAsync(dst, src, width, kind, stream));
  } else {
    JO_RETURN_IF_HIP_ERROR(hipMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, kind, stream));
  }
  return {};
}

// Calls piece(p) for each piece of copy_pieces(width, height, max_bytes), in order, until one fails.
template <class Piece>
Status for_each_piece(uint64_t width, uint64_t height, uint64_t max_bytes, Piece&& piece) {
  if (width == 0 || height == 0) return {};
  const uint64_t cap = std::max<uint64_t>(16, max_bytes / 16 * 16);
  if (width <= cap) {
    const uint64_t rows = cap / width;  // whole rows per piece: all of them when the copy fits
    for (uint64_t row = 0; row < height; row += rows)
      JO_RETURN_IF_ERROR(piece(CopyPiece{row, 0, width, std::min(rows, height - row)}));
    return {};
  }
  for (uint64_t row = 0; row < height; ++row)
    for (uint64_t offset = 0; offset < width; offset += cap)
      JO_RETURN_IF_ERROR(piece(CopyPiece{row, offset, std::min(cap, width - offset), 1}));
  return {};
}

// The self-test's copies, as the schedule makes them: one contiguous copy of
// the first half of the pattern (x into its slot, a pull of one batch
// element), then rows of one length at two pitches (a batched pull) from the
// second half. Every size a multiple of 16 bytes, as the schedule's are.
constexpr uint64_t kHalf = kCopyCheckBytes / 2;
constexpr uint64_t kRows = 6;
constexpr uint64_t kRowBytes = 3120;
constexpr uint64_t kSrcPitch = 5120;
constexpr uint64_t kDstPitch = 3136;
static_assert((kRows - 1) * kSrcPitch + kRowBytes <= kHalf && (kRows - 1) * kDstPitch + kRowBytes <= kHalf,
              "the rows fit the pattern's second half and its copy");

// Faults (runtime/faults.h) that make the self-test see bytes that did not
// land, so that initialize()'s fallbacks run on a GPU whose copies all work:
// copy_selftest_engine_fails, copy_selftest_d2d_fails and
// copy_selftest_kernel_fails drop the self-test's copies on kEngine,
// kDeviceToDevice and kKernel, leaving the destination as it was (as a copy
// lost to ROCm/rocm-systems #11318 does). The calls' copies are not affected.
bool selftest_copy_dropped(CopyPath path) {
  switch (path) {
    case CopyPath::kEngine: return faults::enabled("copy_selftest_engine_fails");
    case CopyPath::kDeviceToDevice: return faults::enabled("copy_selftest_d2d_fails");
    case CopyPath::kKernel: return faults::enabled("copy_selftest_kernel_fails");
  }
  return false;
}

uint32_t seed_of(int64_t owner) { return static_cast<uint32_t>(owner); }

// Waits for `done` up to `timeout_seconds`; *stalled when it did not come. Fault copy_selftest_stalls: the
// wait gives up at once, as on a copy that never finishes, so that the stalled path runs on a healthy GPU.
Status wait_bounded(hipEvent_t done, double timeout_seconds, bool* stalled) {
  const auto start = std::chrono::steady_clock::now();
  *stalled = faults::enabled("copy_selftest_stalls");
  while (!*stalled) {
    const hipError_t e = hipEventQuery(done);
    if (e == hipSuccess) return {};
    if (e != hipErrorNotReady) JO_RETURN_IF_HIP_ERROR(e);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    *stalled = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_seconds;
  }
  return {};
}

}  // namespace

const char* copy_path_name(CopyPath path) {
  switch (path) {
    case CopyPath::kEngine: return "copy_engine";
    case CopyPath::kDeviceToDevice: return "device_to_device";
    case CopyPath::kKernel: return "kernel";
  }
  return "?";
}

std::string describe_copy_path(CopyPath path) {
  switch (path) {
    case CopyPath::kEngine: return std::string("the copy engine (") + gpu::kEngineCopyKindName + ")";
    case CopyPath::kDeviceToDevice:
      return std::string("plain device-to-device copies (") + gpu::kPlainCopyKindName + ")";
    case CopyPath::kKernel: return "a copy kernel on a few SMs";
  }
  return "?";
}

bool parse_copy_path(const std::string& name, CopyPath* out) {
  for (CopyPath p : kCopyPaths)
    if (name == copy_path_name(p)) {
      *out = p;
      return true;
    }
  return false;
}

uint64_t max_copy_bytes() {
  // Fault copy_max_bytes=N: copies split at N bytes (below kMaxCopyBytes) instead, so that the split runs in
  // tests on copies of any size. One relaxed load when no fault is set.
  const int64_t forced = faults::value("copy_max_bytes", 0);
  return forced > 0 && static_cast<uint64_t>(forced) < kMaxCopyBytes ? static_cast<uint64_t>(forced) : kMaxCopyBytes;
}

std::vector<CopyPiece> copy_pieces(uint64_t width, uint64_t height, uint64_t max_bytes) {
  std::vector<CopyPiece> pieces;
  (void)for_each_piece(width, height, max_bytes, [&](const CopyPiece& p) -> Status {
    pieces.push_back(p);
    return {};
  });
  return pieces;
}

Status copy_2d(CopyPath path, void* dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch, uint64_t width,
               uint64_t height, hipStream_t stream, uint64_t max_bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  return for_each_piece(width, height, max_bytes, [&](const CopyPiece& p) {
    return enqueue_piece(path, d + p.row * dst_pitch + p.offset, dst_pitch, s + p.row * src_pitch + p.offset,
                         src_pitch, p.width, p.height, stream);
  });
}

Status copy_rows(CopyPath path, char* dst, int64_t dst_batch_stride, const char* src, int64_t src_batch_stride,
                 int64_t batch, int64_t rows, int64_t cols, int elem_bytes, hipStream_t stream) {
  return copy_2d(path, dst, static_cast<uint64_t>(dst_batch_stride) * elem_bytes, src,
                 static_cast<uint64_t>(src_batch_stride) * elem_bytes, static_cast<uint64_t>(rows * cols) * elem_bytes,
                 static_cast<uint64_t>(batch), stream, max_copy_bytes());
}

hipError_t fill_copy_pattern(void* area, int64_t owner, hipStream_t stream) {
  return launch_fill_pattern(area, kCopyCheckBytes, seed_of(owner), stream);
}

Status check_copy_path(CopyPath path, const char* pattern, int64_t owner, char* scratch, hipStream_t stream,
                       double timeout_seconds, uint64_t* wrong_words, bool* stalled) {
  *stalled = false;
  if (path == CopyPath::kEngine && !kEngineLeavesCusFree) return engine_path_refused();
  uint32_t* wrong = reinterpret_cast<uint32_t*>(scratch + kCopyCheckBytes);
  JO_RETURN_IF_HIP_ERROR(hipMemsetAsync(scratch, kPatternPoison, kCopyCheckBytes, stream));
  JO_RETURN_IF_HIP_ERROR(hipMemsetAsync(wrong, 0, sizeof(uint32_t), stream));
  if (!selftest_copy_dropped(path)) {
    JO_RETURN_IF_ERROR(copy_2d(path, scratch, kHalf, pattern, kHalf, kHalf, 1, stream, max_copy_bytes()));
    JO_RETURN_IF_ERROR(copy_2d(path, scratch + kHalf, kDstPitch, pattern + kHalf, kSrcPitch, kRowBytes, kRows,
                               stream, max_copy_bytes()));
  }
  const uint32_t seed = seed_of(owner);
  JO_RETURN_IF_HIP_ERROR(launch_check_pattern(PatternCheck{scratch, kHalf, kHalf, kHalf, 1, 0, kHalf, seed}, wrong,
                                              stream));
  JO_RETURN_IF_HIP_ERROR(launch_check_pattern(
      PatternCheck{scratch + kHalf, kHalf, kDstPitch, kRowBytes, kRows, kHalf, kSrcPitch, seed}, wrong, stream));
  hipEvent_t done = nullptr;
  JO_RETURN_IF_HIP_ERROR(hipEventCreateWithFlags(&done, hipEventDisableTiming));
  const hipError_t recorded = hipEventRecord(done, stream);
  const Status waited = recorded == hipSuccess ? wait_bounded(done, timeout_seconds, stalled) : Status{};
  (void)hipEventDestroy(done);  // released once it completes, if ever
  JO_RETURN_IF_HIP_ERROR(recorded);
  JO_RETURN_IF_ERROR(waited);
  if (*stalled) return {};
  uint32_t count = 0;
  JO_RETURN_IF_HIP_ERROR(hipMemcpy(&count, wrong, sizeof(count), hipMemcpyDeviceToHost));
  *wrong_words = count;
  return {};
}

}  // namespace jo::pipelined
