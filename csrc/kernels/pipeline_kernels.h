// Device work of the pipelined algorithm (csrc/pipelined/): bounded waits on
// its flags, matmul_rs's fixed-order reduction, and the poisoning of the
// outputs of a call the watchdog aborted. Everything else it runs is the
// vendor GEMM and copy-engine transfers.
#pragma once

#include <cstdint>

#include "kernels/params.h"
#include "platform/gpu.h"

namespace jo {

// A flag of the pipelined protocol: the low 32 bits of the epoch of the call
// that released it (params.h EpochCounter) and that call's site
// (jax_overlap/runtime/workspace.py numbers the call sites sharing a region, 1 to
// 65535). A release writes `epoch`, then `site`, each a stream write
// preceded by a memory fence (or, for done flags, a system-scope release
// store of the verify kernel); a reader acquires `epoch`, then `site`. The
// site, written last, is the release: a site that is no call site means
// "not released", so every release has one (done flags carry the reader's).
// Before a writer overwrites the data a pub or ready flag released, it marks
// the flag kSiteRewriting; its next release then goes (old epoch, rewriting)
// -> (new epoch, rewriting) -> (new epoch, site), and no reader ever takes a
// half-written release (epoch of one, site of another) for a whole one.
struct alignas(8) PipeFlag {
  uint32_t epoch;
  uint32_t site;
};

// PipeFlag::site values that are no call site.
inline constexpr uint32_t kSiteRewriting = 0;           // the data released is being overwritten (also: a zeroed flag)
inline constexpr uint32_t kSiteAbandoned = 0xFFFFFFFFu;  // the writer abandoned this epoch: no data will come

enum class PipeState : uint32_t { kPending, kReleased, kOtherSite, kAbandoned };

// What a reader makes of a flag holding {epoch, site} when it waits for
// `want_epoch` released by call site `want_site` (0: any site, as on done
// flags). Only the exact epoch counts (see region_layout.h match). A flag whose
// site is kSiteRewriting is pending: not yet released for that epoch, or
// being written again; so is a flag still zero since the workspace was
// zeroed, also when the epoch waited for has low bits 0 (every 2^32nd call,
// or a region's first from an origin such as 2^32). kSiteAbandoned: the
// writer could not run its part of that epoch (schedule.h run_call).
JO_HOST_DEVICE PipeState pipe_state(uint32_t epoch, uint32_t site, uint32_t want_epoch, uint32_t want_site) {
  if (epoch != want_epoch || site == kSiteRewriting) return PipeState::kPending;
  if (site == kSiteAbandoned) return PipeState::kAbandoned;
  return want_site == 0 || site == want_site ? PipeState::kReleased : PipeState::kOtherSite;
}

// Waits, in one launch, until every listed flag holds `epoch` exactly (and,
// when `site` is nonzero, was released by that call site). On a timeout, a
// flag released for another call site, or one its writer abandoned
// (WaitOn::kPeerAbandoned), it records the error, sets the abort flag and
// returns; it also returns as soon as another wait of this GPU did.
struct FlagWait {
  const PipeFlag* flags[kMaxWorld];
  uint32_t peers[kMaxWorld];  // the rank that releases each flag, for the error record
  int count;
  uint32_t epoch;  // low 32 bits
  uint32_t site;
  WaitOn what;
  uint32_t rank;
  uint32_t world;
  Watchdog wd;
};
hipError_t launch_flag_wait(const FlagWait& wait, hipStream_t stream);

// The end of a call's pulls (after them on the copy stream, so after they
// completed): each flag the pulls relied on must still hold (epoch, site),
// else its writer marked it rewritten (or released it again) after the wait
// matched, and some of the bytes pulled may be its new data. Then this
// records the overwrite (WaitOn::kOverwritten; kPeerAbandoned when the writer
// abandoned the epoch after releasing) and sets the abort flag, so the
// call's outputs become NaN; else it releases the matching done flag in the
// writer's region for (epoch, site), which lets the writer overwrite.
struct FlagVerify {
  const PipeFlag* flags[kMaxWorld];  // the pub / ready flags the pulls waited for, one per peer
  PipeFlag* done[kMaxWorld];         // this rank's done flag in that peer's region
  uint32_t peers[kMaxWorld];
  int count;
  uint32_t epoch;  // low 32 bits
  uint32_t site;
  uint32_t rank;
  uint32_t world;
  Watchdog wd;
};
hipError_t launch_flag_verify(const FlagVerify& verify, hipStream_t stream);

// A call this rank cannot run (its enqueue failed, or its GPU refuses calls
// after an error), ended so that its peers fail at once instead of waiting
// for the watchdog: one thread, on the caller's stream after everything the
// call enqueued. It waits for the readers of the slots it is about to mark
// (as a rewrite would), sets every flag the peers wait on for this epoch to
// (epoch, kSiteAbandoned), releases this rank's done flags in the peers'
// regions (it reads nothing more), and records WaitOn::kEnqueueFailed for
// this rank (setting its abort flag) unless an error is recorded already.
// A done flag is released only once the peer's flag that follows its wait
// for this reader's done flag of two calls ago (the same word, the same slot
// parity) reads this epoch, as a reader's done follows the peer's release:
// released sooner, it would overwrite the value that wait is for.
struct FlagAbandon {
  const PipeFlag* readers_done[kMaxWorld];  // in this rank's region: the readers of the unreleased flags' slots
  uint32_t readers[kMaxWorld];
  int reader_count;                         // 0 when those slots were not used two calls ago
  PipeFlag* own[kMaxWorld];                 // ag: the pub flag; rs: the ready flag of each peer's block
  uint32_t released;                        // bit i: own[i] was released for this epoch already
  int own_count;
  PipeFlag* done[kMaxWorld];                // this rank's done flags in the peers' regions, still to release
  const PipeFlag* done_after[kMaxWorld];    // each one's peer's flag for this rank (ag: pub, rs: ready)
  uint32_t done_peers[kMaxWorld];
  int done_count;
  uint32_t epoch;  // low 32 bits
  uint32_t site;
  uint32_t rank;
  uint32_t world;
  Watchdog wd;
};
hipError_t launch_flag_abandon(const FlagAbandon& abandon, hipStream_t stream);

// Fills each area with NaN when this GPU's watchdog has fired: then no
// output of the aborted call, or of a call queued behind it, looks like a
// result. An area of any size (ag_matmul's gathered scales are a few floats),
// filled with its dtype's nan_fill_byte.
struct PoisonArea {
  void* p;
  uint64_t bytes;
  unsigned char fill;
};
inline constexpr int kMaxPoisonAreas = 3;
hipError_t launch_poison_if_aborted(const uint32_t* abort, const PoisonArea* areas, int count, hipStream_t stream);
// Two areas of 16-bit NaN (0xFF bytes), as the 16-bit calls' outputs are.
hipError_t launch_poison_if_aborted(const uint32_t* abort, void* a, uint64_t a_bytes, void* b, uint64_t b_bytes,
                                    hipStream_t stream);

// ag_matmul's float8 tensor scales (schedule.h): dst[i] = *src[i] for i < count, one
// thread each, on the copy stream. A float is no 16-byte vector, which the
// copy paths are verified for (pipelined/copy.h): a scale moves by kernel.
struct ScaleCopy {
  const float* src[kMaxWorld];
  float* dst[kMaxWorld];
  int count;
};
hipError_t launch_copy_scales(const ScaleCopy& copy, hipStream_t stream);

// Fault injection (runtime/faults.h): one thread spins for `ticks` timer
// ticks, holding back the work enqueued behind it on `stream`.
hipError_t launch_pause(uint64_t ticks, hipStream_t stream);

// Fills `elems` values of `dtype` with pseudo-random values (a hash of the
// index and `seed`): the operands of the GEMMs the cost model times, which
// run faster on constant data (less switching, higher clocks under the power
// cap) than on real data. In [-1, 1) for the 16-bit types and float32; for
// the float8 formats, random signs, mantissas and exponents of magnitudes in
// [2^(1 - exponent bias), 1), never zero, NaN or infinite.
hipError_t launch_fill_random(void* p, uint64_t elems, DType dtype, uint32_t seed, hipStream_t stream);

// How far `elems` values of `dtype` (bfloat16, float16 or float32) in `got` are from those in `want`, on the
// GPU (blas/tuning.cc checks each candidate algorithm's product against the heuristic's first): `mismatches`
// counts the values farther than rel * (|want| + mean |want|) from want's, NaN included. The caller zeroes the
// stats before the launch and reads them after it.
struct CompareStats {
  double sum_abs;  // of want's values
  unsigned long long mismatches;
};
hipError_t launch_compare(const void* got, const void* want, uint64_t elems, DType dtype, float rel,
                          CompareStats* stats, hipStream_t stream);

// matmul_rs's reduction of one rank's row block, rows of n:
//   out[b][i][j] = round(sum_{q = 0 .. count-1} partial_q[b][i][j] + bias[j])
// summed in fp32 in rank order (bitwise reproducible; the fused kernel's
// numerics), the bias (the partials' dtype or float32) added once, NaN
// everywhere when the watchdog has fired.
struct ReduceArgs {
  DType dtype;       // out's (bfloat16, float16 or float32)
  DType bias_dtype;  // dtype or float32
  const void* partials[kMaxWorld];        // [batch][rows][n] each of partial_dtype(dtype), rows contiguous
  int64_t partial_batch_stride[kMaxWorld];  // elements between batch elements
  int count;
  const void* bias;  // [n] or nullptr
  void* out;         // [batch][rows][n]
  int64_t batch, rows, n;  // n a multiple of 16 bytes' elements
  const uint32_t* abort;  // nullptr: never poisoned (loopback)
};
hipError_t launch_reduce(const ReduceArgs& args, int sm_count, hipStream_t stream);

}  // namespace jo
