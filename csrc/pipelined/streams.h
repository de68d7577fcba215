// The side streams a rank's pipelined calls run on, forked from and joined
// back into XLA's stream with events: one copy stream at the device's highest
// priority (transfers and their signals), and two compute streams that take
// the chunk GEMMs in turn, so one GEMM's partial last wave can overlap the
// next; each compute stream has a vendor BLAS handle of its own (blas/gemm.h
// says why). A GPU's own, which the FFI handlers' calls run on, are made when
// the runtime sets the GPU up (prepare_side_streams, from Runtime::init_device:
// never inside an execute handler, where a stream made while another stream's
// wait kernel spins can deadlock on ROCm, rocm-systems #2652) and kept until
// the runtime frees the GPU's state after a device sync (release_side_streams).
// Their BLAS handles come when the vendor BLAS is prepared (at lowering:
// attach_side_stream_blas). Simulated ranks (SimGroup) and the loopback
// timings make their own with create().
//
// Every cross-stream edge of a call goes through wait() and record(), which
// count them: on ROCm >= 7.14 each wait slows every later kernel of the waiting
// stream by about 1 us (rocm-systems #11212), so a call forks and joins only
// the streams its schedule gives work (StreamSet).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

#include "blas/gemm.h"
#include "kernels/params.h"
#include "platform/status.h"

namespace jo::pipelined {

// Which side streams a call uses: bits of kCopy, kCompute0, kCompute1.
using StreamSet = unsigned;
inline constexpr StreamSet kCopy = 1u, kCompute0 = 2u, kCompute1 = 4u;

// Cross-stream edges enqueued so far.
struct StreamEdges {
  int64_t records = 0;
  int64_t waits = 0;
};

struct SideStreams {
  hipStream_t copy = nullptr;
  hipStream_t compute[2] = {};
  blas::Handle blas[2] = {};               // compute[i]'s vendor BLAS handle (attach_blas)
  hipEvent_t fork = nullptr;                // recorded on the caller's stream
  hipEvent_t finished[3] = {};             // copy, compute[0], compute[1]
  hipEvent_t arrived[kMaxWorld] = {};      // ag_matmul: ring position i's shard is in `gathered`
  StreamEdges edges;                        // under mu
  // One call enqueues at a time: calls share the events (a later call's
  // record does not disturb waits an earlier one already enqueued).
  std::mutex mu;

  // Streams and events on GPU `ordinal` (made current for the call).
  static Status create(int ordinal, std::unique_ptr<SideStreams>* out);
  ~SideStreams();

  // Makes the compute streams' BLAS handles on `blas`'s GPU (idempotent).
  Status attach_blas(blas::DeviceBlas& blas);
  bool has_blas() const { return blas[0] != nullptr && blas[1] != nullptr; }

  // The streams of `used` wait for the work `origin` holds so far.
  Status fork_from(hipStream_t origin, StreamSet used);
  // `origin` waits for everything enqueued on the streams of `used` so far.
  Status join_into(hipStream_t origin, StreamSet used);
  // One edge: `waiter` waits for `event`'s last record; `event` recorded on `stream`.
  Status wait(hipStream_t waiter, hipEvent_t event);
  Status record(hipEvent_t event, hipStream_t stream);

 private:
  blas::DeviceBlas* blas_owner_ = nullptr;
};

// Makes GPU `ordinal`'s side streams if it has none, with their BLAS handles
// where its vendor BLAS is prepared already (Runtime::init_device).
Status prepare_side_streams(int ordinal);
// Gives GPU `ordinal`'s side streams their BLAS handles (prepare_vendor_blas, at lowering).
Status attach_side_stream_blas(int ordinal);
// GPU `ordinal`'s side streams, with their BLAS handles; an error when the
// runtime has not made them (no stream or handle is made here: execute handlers ask).
Status device_side_streams(int ordinal, SideStreams** out);
// Destroys GPU `ordinal`'s side streams, when nothing runs on them any more
// (Runtime::release, after a device sync); the next set-up makes new ones.
void release_side_streams(int ordinal);

}  // namespace jo::pipelined
