// The side streams a rank's pipelined calls run on, forked from and joined
// back into XLA's stream with events: one copy stream at the device's highest
// priority (transfers and their signals), and two compute streams that take
// the chunk GEMMs in turn, so one GEMM's partial last wave can overlap the
// next. Made once per GPU (per simulated rank in SimGroup) outside any
// execute handler's hot path and never destroyed while calls may run. The
// GPUs' own, which the FFI handlers' calls run on, are kept here
// (device_side_streams) until the runtime frees the GPU's state
// (release_side_streams).
#pragma once

#include <memory>
#include <mutex>

#include "kernels/params.h"
#include "platform/status.h"

namespace jo::pipelined {

struct SideStreams {
  hipStream_t copy = nullptr;
  hipStream_t compute[2] = {};
  hipEvent_t fork = nullptr;                // recorded on the caller's stream
  hipEvent_t finished[3] = {};             // copy, compute[0], compute[1]
  hipEvent_t arrived[kMaxWorld] = {};      // ag_matmul: ring position i's shard is in `gathered`
  hipEvent_t pulled = nullptr;             // matmul_rs: the peers' partials are pulled and checked
  hipEvent_t staged[2] = {};               // matmul_rs: my own block's partial, its first columns / all of it
  // One call enqueues at a time: calls share the events (a later call's
  // record does not disturb waits an earlier one already enqueued).
  std::mutex mu;

  // Streams and events on GPU `ordinal` (made current for the call).
  static Status create(int ordinal, std::unique_ptr<SideStreams>* out);
  ~SideStreams();

  // The side streams wait for the work `origin` holds so far.
  Status fork_from(hipStream_t origin);
  // `origin` waits for everything enqueued on the side streams so far.
  Status join_into(hipStream_t origin);
};

// GPU `ordinal`'s side streams, made on first use.
Status device_side_streams(int ordinal, SideStreams** out);
// Destroys GPU `ordinal`'s side streams, when nothing runs on them any more
// (Runtime::release, after a device sync); the next call makes new ones.
void release_side_streams(int ordinal);

}  // namespace jo::pipelined
