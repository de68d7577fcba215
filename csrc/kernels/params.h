// Types shared by the kernels' launchers, the FFI handlers and the runtime:
// no device code and no XLA types here.
#pragma once

#include <cstdint>

#include "platform/gpu.h"
#include "runtime/error_record.h"

namespace jo {

// Largest communication group a kernel takes (size of the per-rank region
// table; jax_overlap/config.py MAX_WORLD must agree).
inline constexpr int kMaxWorld = 8;

enum class DType : int { kBF16 = 0, kF16 = 1 };

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

// What every fused launch carries besides its operands.
struct CallContext {
  Peers peers;
  uint32_t epoch;  // this call's epoch on the group's region (0 for world 1)
  Watchdog wd;
  TraceSink trace;
  LaunchLimits limits;
};

// Scratch of a group-of-one call's stream-K tail (gemm/tile_order.h
// TailSplit): `slots` flags, then `slots` fp32 tiles, as left by earlier
// users. data == nullptr: whole tiles only.
struct TailScratch {
  void* data;
  int slots;
  uint64_t timeout_ticks;  // a wait on a partial tile longer than this traps
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
  int workers;  // fetcher (ag_matmul) or reducer (matmul_rs) workgroups when world > 1
};

// A block tile compiled into the GEMM kernels (gemm/tile_shapes.h), as the
// host and Python see it.
struct TileShapeInfo {
  int bm, bn, bk, threads, smem_bytes;
  bool stream_k;  // its group-of-one kernels can end in the stream-K tail (gemm/tile_order.h)
};
inline constexpr int kTileShapeCount = 2;
// False when no tile shape has this index.
bool tile_shape_info(int index, TileShapeInfo* info);

}  // namespace jo
