// Types shared by the kernels' launchers, the FFI handlers and the runtime:
// no device code and no XLA types here.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/error_record.h"
#include "platform/gpu.h"

namespace jo {

// Largest communication group a kernel takes (size of the per-rank region
// table; jax_overlap/planning MAX_WORLD must agree).
inline constexpr int kMaxWorld = 8;

// Bounded waits: every spin on a flag another workgroup or GPU writes gives
// up after timeout_ticks, records the wait in *record and makes the kernel
// exit: it sets *abort, which the other spinning workgroups poll, and leave.
// The abort flag is in device memory because the pollers read it in their
// spin loops: with host-mapped memory there, those reads cut a concurrent
// peer pull from 141 to 6.6 GB/s (benchmarks/p2p, 2 x H200).
struct Watchdog {
  ErrorRecord* record;  // device pointer to host-mapped memory
  uint32_t* abort;      // this rank's workspace; cleared with the record
  uint64_t timeout_ticks;
  uint32_t op;  // OpKind
};

enum class TraceKind : uint32_t { kGemmTile = 0, kWait = 1, kFetch = 2, kPublish = 3, kReduce = 4 };

struct TraceEvent {
  uint64_t start;
  uint64_t end;
  uint32_t block;
  uint32_t kind;  // TraceKind
  uint32_t arg0;  // tile / chunk index
  uint32_t arg1;  // shard or peer rank
};

// Opt-in per-workgroup trace in the workspace; events == nullptr: none. The
// on/off switch is a device word, read as events are recorded, so a launch
// recorded into a CUDA/HIP graph follows jax_overlap.initialize(trace=...)
// when it replays, not the setting it was recorded under.
struct TraceSink {
  TraceEvent* events;
  uint32_t* count;
  const uint32_t* enabled;
  uint32_t capacity;
};

// The symmetric regions of one call: regions[r] is rank r's region as mapped
// in this process (same offset in every rank's workspace). Kernels read it
// through region() only: indexing a kernel-parameter array with a run-time
// rank makes the compiler copy the array to scratch memory.
struct Peers {
  char* regions[kMaxWorld];
  int rank;
  int world;

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
  JO_DEVICE char* region(int r) const {
    char* out = nullptr;
#pragma unroll
    for (int i = 0; i < kMaxWorld; ++i)
      if (i == r) out = regions[i];
    return out;
  }
#endif
};

// Where a launch may run: persistent kernels must be co-resident, so the
// grid is capped by what the SMs this rank owns can hold at once.
struct LaunchLimits {
  int sm_count;
  int ranks_per_gpu;  // ranks sharing this GPU (emulated groups): SMs and L2 are split
  int64_t l2_bytes;
};

// A region's call counter on one rank, in 64 bits (it never wraps). Flags
// hold an epoch's low 32 bits (pipelined) or 16 (fused): exact, because every
// flag of a region is rewritten every call or two, so a flag's value is never
// more than two epochs old. `origin` is the count when the region's flags were
// last zeroed (0 at allocation and after clear_errors();
// Runtime::set_epoch_origin moves it for tests), so the region's first call
// is origin + 1, whatever its low bits are.
struct EpochCounter {
  uint64_t origin = 0;
  uint64_t count = 0;

  void restart(uint64_t at) { origin = count = at; }
  // A plain increment: its caller holds the GPU's ffi/common.h EnqueueClaim (one enqueuer per GPU).
  uint64_t next() { return ++count; }
  // Whether the call of `epoch` finds its parity's slots used by the call two
  // epochs before (since the flags were zeroed): then it waits for that call's
  // readers before writing them. Relative to the origin, not to 0, so it holds
  // across any wrap of the flags' bits and from any origin.
  bool slot_used(uint64_t epoch) const { return epoch - origin > 2; }
};

// What every fused launch carries besides its operands.
struct CallContext {
  Peers peers;
  uint64_t epoch;  // this call's epoch on the group's region (0 for world 1); flags hold its low bits
  uint32_t site;   // this call site's number among those sharing the region, 1 to 65535 (0 for world 1)
  bool slot_used;  // EpochCounter::slot_used(epoch)
  Watchdog wd;
  TraceSink trace;
  LaunchLimits limits;
};

// Scratch of a group-of-one call's stream-K tail (gemm/tile_scheduler.h
// TailSplit): `slots` flags, then `slots` fp32 tiles, as left by earlier
// users. data == nullptr: whole tiles only.
struct TailScratch {
  void* data;
  int slots;
  uint64_t timeout_ticks;  // a wait on a partial tile longer than this is recorded (WaitOn::kTailPartial)
};

// The GEMM operands and schedule of a fused ag_matmul / matmul_rs launch.
struct GemmOperands {
  DType dtype;
  int tile;       // index into gemm/tile_shapes.h
  bool w_kmajor;  // w is [n, k] instead of [k, n]
  const void* x;
  const void* w;
  const void* bias;  // [n] or nullptr
  int64_t batch;     // product of x's leading dims
  int64_t k, n;
  int comm_workgroups;  // fetchers (ag_matmul) or reducers (matmul_rs) when world > 1
};

// A persistent GEMM kernel's launch as the launcher makes it, computed by one
// function per op (kernels/launch.h gemm_geometry) for the launch and, through
// the Python module, for the planner (jax_overlap/runtime/backend.py GemmGeometry).
struct GemmGeometry {
  int workgroups_per_sm;  // of this kernel, by its occupancy
  int co_resident;        // workgroups that run at once on this rank's share of the GPU
  int comm_workgroups;    // fetchers / reducers among them (0 at world 1)
  int grid;               // workgroups launched: min(co_resident, comm_workgroups + tiles)
  int64_t tiles;          // output tiles of all groups (the world's shards or row blocks)
  int group_cols;         // tile columns per band (gemm/tile_order.h)
  int tail_slots;         // group of one: slots of its stream-K tail scratch (0: none)
  uint64_t tail_scratch_bytes;
  uint64_t region_bytes;  // the call's symmetric region (0 at world 1)
};

}  // namespace jo
