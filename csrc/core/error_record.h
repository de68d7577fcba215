// The record a kernel leaves when a wait on a peer times out. It lives in
// host-mapped pinned memory (one per local GPU), so the host reads it without
// a device sync; the first workgroup to time out claims it, fills it, then
// sets `valid` with a system-scope release.
#pragma once

#include <cstdint>

#include "core/op_kind.h"

namespace jo {

// Which flag a wait was on.
enum class WaitOn : uint32_t {
  kPublished = 1,  // a peer's published shard chunk (ag_matmul, all_gather)
  kStaged = 2,     // a chunk staged locally by this GPU's fetchers
  kReadersDone = 3,  // peers finished reading a slot about to be overwritten
  kPartialReady = 4,  // a peer's staged partial-product tile (matmul_rs)
  kCallSite = 5,      // a peer released this epoch for another call site: the ranks' call orders differ
  kTailPartial = 6,   // a stream-K tail piece of the same launch (a group of one; a bug, not a peer)
  kOverwritten = 7,   // a peer rewrote the data this rank was pulling (it had given up on a call)
  kPeerAbandoned = 8,  // a peer abandoned the epoch (it could not enqueue its part, or refused the call)
  kEnqueueFailed = 9,  // this rank could not enqueue its part of a pipelined call and abandoned the epoch
};

struct ErrorRecord {
  uint32_t claimed;  // 0 -> 1 by the first workgroup that times out
  uint32_t valid;    // set last: the fields below are complete
  uint32_t op;       // OpKind
  uint32_t rank;
  uint32_t peer;     // rank waited for
  uint32_t world;
  uint32_t epoch;
  uint32_t what;     // WaitOn
  uint64_t waited_ticks;
};

// Whether a kernel has completed a record: an acquire on `valid`, so the
// fields it published before are read after it.
inline bool error_recorded(const ErrorRecord& r) { return __atomic_load_n(&r.valid, __ATOMIC_ACQUIRE) != 0; }

inline const char* wait_name(uint32_t what) {
  switch (static_cast<WaitOn>(what)) {
    case WaitOn::kPublished: return "published shard chunk";
    case WaitOn::kStaged: return "locally staged chunk";
    case WaitOn::kReadersDone: return "readers done with slot";
    case WaitOn::kPartialReady: return "partial-product tile";
    case WaitOn::kCallSite: return "the same call site (the peer released this epoch for another one)";
    case WaitOn::kTailPartial: return "stream-K tail partial of the same launch";
    case WaitOn::kOverwritten: return "the data it released, still unchanged after the pull";
    case WaitOn::kPeerAbandoned: return "its part of the epoch, which it abandoned";
    case WaitOn::kEnqueueFailed: return "its own enqueue, which failed";
  }
  return "unknown flag";
}

}  // namespace jo
