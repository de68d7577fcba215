// The runtime behind every GPU call: per local GPU, a small device state (the
// watchdog's abort flag and error record, the trace buffer, the options) made
// when a program first lowers a call onto that GPU, and the symmetric
// workspace that groups of two or more need, made only by
// jax_overlap.initialize() when such a call takes a workspace path (never
// during graph capture or inside an execute handler). The workspace is zeroed
// once, so every flag starts at epoch 0; peers' workspaces are mapped into
// this process once: by peer access between local GPUs, or by IPC handles
// exchanged through the jax.distributed key-value store. FFI handlers cannot
// receive Python objects, so they find this state through Runtime::instance()
// by their device ordinal.
//
// Regions of the workspace are placed by jax_overlap/runtime/workspace.py at offsets
// every rank of a group agrees on; each region has a host-side call counter
// (its epoch). shutdown() frees the workspaces and starts a new generation:
// a compiled call lowered under another generation refuses to run.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/error_record.h"
#include "kernels/params.h"
#include "pipelined/copy.h"
#include "platform/gpu.h"
#include "platform/status.h"

namespace jo {

// Default bound on every wait on a peer: minutes, like NCCL's, so that a peer
// writing a checkpoint or waiting on its data loader is a straggler, not a
// failure (jax_overlap/runtime/workspace.py reads it from here).
inline constexpr double kDefaultWatchdogSeconds = 600.0;

// The device state's header: [trace counter | abort flag | trace switch | trace events].
inline constexpr uint32_t kTraceCapacity = 1u << 16;  // events per GPU (2 MiB)
inline constexpr uint64_t kAbortFlagOffset = 64;  // Watchdog::abort
inline constexpr uint64_t kTraceEnabledOffset = 128;  // TraceSink::enabled
inline constexpr uint64_t kTraceEventsOffset = 256;
inline constexpr uint64_t kHeaderBytes =
    (kTraceEventsOffset + kTraceCapacity * sizeof(TraceEvent) + 4095) / 4096 * 4096;

struct DeviceInfo {
  int sm_count = 0;
  int smem_per_block = 0;
  int64_t l2_bytes = 0;
  std::string pci_bus_id;
  std::string arch;
  std::string name;
  int64_t ticks_per_second = 0;
};

Status query_device(int ordinal, DeviceInfo* info);

// The error of a call on a GPU the runtime has not set up.
Status not_initialized(int ordinal);

// Timer ticks of a watchdog bound; infinity (or any bound past the counter's
// range) never times out.
uint64_t timeout_ticks(double seconds, int64_t ticks_per_second);

// Everything this process knows about one of its GPUs.
struct Workspace {
  int ordinal = -1;
  int64_t global_id = -1;
  DeviceInfo info;
  char* header = nullptr;               // device memory, kHeaderBytes
  ErrorRecord* error_host = nullptr;    // host-mapped pinned memory
  ErrorRecord* error_device = nullptr;  // the same, as the kernels address it
  int ranks_per_gpu = 1;
  uint64_t timeout_ticks = 0;
  bool sync_after_launch = false;  // debugging: surface watchdog errors on the failing call

  // The symmetric workspace (groups of two or more), absent until allocated:
  // `bytes` of regions from `base`, after pipelined::kCopyCheckBytes of this
  // GPU's copy self-test pattern (the allocation starts there).
  char* base = nullptr;
  uint64_t bytes = 0;
  std::map<int64_t, char*> peer_bases;  // global device id -> its workspace here (own included)
  std::vector<void*> ipc_mappings;
  std::map<uint64_t, std::unique_ptr<EpochCounter>> epochs;  // region offset -> its calls on this GPU
  // The path of this GPU's pipelined copies (pipelined::CopyPath), verified by
  // Runtime::choose_copy_path; -1 until then.
  std::atomic<int> copy_path{-1};

  TraceSink trace_sink() const;
  uint32_t* abort_flag() const { return reinterpret_cast<uint32_t*>(header + kAbortFlagOffset); }
  LaunchLimits limits() const { return {info.sm_count, ranks_per_gpu, info.l2_bytes}; }
  Watchdog watchdog(OpKind op) const {
    return Watchdog{error_device, abort_flag(), timeout_ticks, static_cast<uint32_t>(op)};
  }
};

// Where a call runs: its rank in the group and every rank's region.
struct GroupBinding {
  Workspace* ws = nullptr;
  Peers peers{};
  EpochCounter* epochs = nullptr;  // the region's call counter; nullptr when world == 1
};

class Runtime {
 public:
  static Runtime& instance();

  // The device state of GPU `ordinal`, and its pipelined side streams (idempotent).
  Status init_device(int ordinal, int64_t global_id);
  // Its symmetric workspace, zeroed (idempotent for the same size).
  Status allocate_workspace(int ordinal, uint64_t bytes);
  Status set_options(int ordinal, double watchdog_seconds, bool sync_after_launch, bool trace);
  // What a recorded timeout does: abort the process with the record printed
  // (true, a monitor thread polls the records), or only poison and refuse.
  void set_abort_on_timeout(bool abort);
  Status export_handle(int ordinal, std::string* handle);
  Status import_peer(int ordinal, int64_t peer_id, const std::string& handle);
  Status map_local_peer(int ordinal, int peer_ordinal);
  // Once every peer is mapped (jax_overlap.initialize()): the first copy path
  // (pipelined/copy.h) whose self-test copies land from every workspace
  // mapped on GPU `ordinal`, its own included, becomes its path; `rejected`
  // says why each earlier path was not taken. No path at all is an error
  // naming the peers, and the GPU keeps no path.
  Status choose_copy_path(int ordinal, pipelined::CopyPath* chosen, std::vector<std::string>* rejected);
  // The path choose_copy_path verified on `ws`'s GPU; an error before one was.
  static Status verified_copy_path(const Workspace& ws, pipelined::CopyPath* out);
  Status set_ranks_per_gpu(int ordinal, int ranks);
  Status read_trace(int ordinal, std::string* events, double* ticks_per_us);
  // After a timeout, in two steps that every rank of every group takes, with
  // a barrier after each (jax_overlap.clear_errors() is collective): stop
  // this GPU's waits (the abort flag) and let its work finish; then zero every
  // flag, restart every epoch counter at the origin (0; set_epoch_origin) and
  // forget the error. No rank can then still write into a zeroed workspace,
  // and the ranks restart in step at epoch origin + 1.
  Status stop_after_error(int ordinal);
  Status restart_after_error(int ordinal);
  // Frees every workspace and device state, and the pipelined side streams
  // (pipelined/streams.h); calls lowered before refuse to run.
  Status release();

  // nullptr when this GPU is not set up.
  Workspace* workspace(int ordinal);
  // Bumped by release(): the generation calls are lowered under.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // Maps a call's `groups` attribute (world ids per group, groups
  // concatenated) to this device's rank and the group's regions.
  Status bind_group(int ordinal, const int64_t* groups, size_t n_ids, int world, uint64_t region_offset,
                    uint64_t region_bytes, GroupBinding* out);
  // Test hook: the origin region epoch counters start from (when made, and
  // after clear_errors()) instead of 0, to run calls across a wrap of the
  // flags' epoch bits (params.h EpochCounter).
  void set_epoch_origin(uint64_t origin);

 private:
  void start_monitor();

  std::mutex mu_;
  std::map<int, std::unique_ptr<Workspace>> devices_;
  std::atomic<uint64_t> generation_{1};
  std::atomic<bool> abort_on_timeout_{true};
  uint64_t epoch_origin_ = 0;  // mu_
  bool monitor_started_ = false;
};

// Forgets a watchdog error on GPU `ordinal`: its abort flag, then its
// host-mapped record (what lets calls launch again).
Status clear_watchdog(int ordinal, ErrorRecord* record, uint32_t* abort_flag);

// Non-empty when a kernel on this GPU recorded a watchdog timeout; the
// message names the op, the ranks and the flag.
std::string describe_error(const ErrorRecord& record, int64_t ticks_per_second);

}  // namespace jo
