// Several simulated ranks on ONE GPU in one process, for protocol tests and
// emulated-rank benchmarks: one workspace, one stream and one set of pipelined
// side streams per rank, the peer table pointing at the sibling workspaces.
// Each op launches the listed ranks' work (every rank's by default), each on
// its own stream, and by default waits for all of them; without that wait, and
// with ranks launched in separate calls, ranks run calls ahead of each other.
// Grids are split so that all ranks' persistent kernels are co-resident
// (ranks_per_gpu = world). All ranks share one CUDA context, where one rank's
// spinning wait can stand in front of the release it waits for in a hardware
// queue two streams share: the most queues and eager module loading make that
// rare (tests/conftest.py), and the pipelined tests that still met it run in
// processes of their own (tests/gpu/multiprocess.py).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "blas/gemm.h"
#include "core/gemm_problem.h"
#include "core/op_kind.h"
#include "kernels/params.h"
#include "pipelined/streams.h"
#include "runtime/runtime.h"

namespace jo {

struct SimMatmul {
  GemmTypes types;  // the fused kernels take 16-bit ones (types.x)
  int tile;
  int comm_workgroups;  // fetchers (ag_matmul) or reducers (matmul_rs)
  int chunk_k;  // ag_matmul only
  bool w_kmajor;
  int64_t batch, m, k, n;  // ag: m local rows; rs: m total rows (per batch element)
  std::vector<uintptr_t> x, w, bias, out, gathered;  // one device pointer per rank (bias may be 0)
  // Pipelined, scaled: each rank's (a device float each, or with types.blocks block scales laid out as
  // pipelined::Operands has them), and ag_matmul's gathered_scales ([world] floats; blocks: [world][k/128][m]).
  std::vector<uintptr_t> x_scale, w_scale;
  std::vector<uintptr_t> gathered_scales;
  std::vector<uintptr_t> scratch;  // pipelined: each rank's scratch (pipelined::scratch_bytes)
  std::vector<int64_t> stages;     // pipelined: the stage plan
  uint32_t site = 1;               // the call site's number among those sharing the region
  std::vector<int> ranks;          // the ranks to launch; empty: all
  bool sync = true;                // wait for the launched ranks before returning

  GemmOperands operands(int rank) const;
};

class SimGroup {
 public:
  static Status create(int ordinal, int world, uint64_t bytes_per_rank, double watchdog_seconds,
                       std::unique_ptr<SimGroup>* out);
  ~SimGroup();

  Status ag_matmul(const SimMatmul& call);
  Status matmul_rs(const SimMatmul& call);
  Status pipelined(OpKind op, const SimMatmul& call);
  // Waits for every rank's stream.
  Status synchronize();
  Status all_gather(const std::vector<uintptr_t>& x, const std::vector<uintptr_t>& gathered, int64_t batch,
                    int64_t m, int64_t row_bytes);
  // Timed-out records, one string per rank that has one.
  std::vector<std::string> errors() const;
  // Forgets every rank's timeout (records and abort flags).
  Status clear_errors();
  int world() const { return world_; }
  // A rank that never launches (-1: none): its peers must time out, not hang.
  void set_absent(int rank) { absent_ = rank; }
  // Test hook: regions made from now on, and every region after
  // clear_errors(), count their epochs from `origin` (Runtime::set_epoch_origin).
  void set_epoch_origin(uint64_t origin) { epoch_origin_ = origin; }

 private:
  SimGroup() = default;
  // The region of `bytes` of the op's fused (or pipelined) calls, placed on first use.
  Status region(OpKind op, bool pipelined, uint64_t bytes, uint64_t* offset);
  // Runs launch(rank, stream, epochs) for each of `ranks` (all when empty)
  // but the absent one, with that rank's epoch counter on the region at
  // `offset` (the launch takes its epoch); then, with `sync`, waits for them.
  Status run(uint64_t offset, const std::vector<int>& ranks, bool sync,
             const std::function<Status(int rank, hipStream_t stream, EpochCounter& epochs)>& launch);
  // Rank `rank`'s view of the region at `offset`, and its watchdog.
  Peers peers(int rank, uint64_t offset) const;
  Watchdog watchdog(int rank, OpKind op) const;
  // A fused call's context on rank `rank`; takes its epoch.
  CallContext context(int rank, uint64_t offset, EpochCounter& epochs, uint32_t site, OpKind op) const;
  // Rank `rank`'s watchdog abort flag (its workspace header, as in Workspace).
  uint32_t* abort_flag(int rank) const { return reinterpret_cast<uint32_t*>(bases_[rank] + kAbortFlagOffset); }

  int ordinal_ = 0;
  int world_ = 0;
  int absent_ = -1;
  uint64_t epoch_origin_ = 0;
  uint64_t bytes_ = 0;
  uint64_t next_offset_ = kHeaderBytes;  // each rank's allocation: its device-state header, then regions
  DeviceInfo info_;
  uint64_t timeout_ticks_ = 0;
  std::vector<char*> bases_;
  std::vector<ErrorRecord*> records_host_;
  std::vector<ErrorRecord*> records_device_;
  std::vector<hipStream_t> streams_;
  std::vector<std::unique_ptr<pipelined::SideStreams>> side_streams_;
  blas::DeviceBlas* blas_ = nullptr;
  std::map<std::tuple<OpKind, bool, uint64_t>, uint64_t> regions_;  // (op, pipelined, bytes) -> offset
  std::map<uint64_t, std::vector<EpochCounter>> epochs_;     // offset -> each rank's counter
};

}  // namespace jo
