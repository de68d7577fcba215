// The symmetric workspace runtime. One device allocation per local GPU, made
// once by jax_overlap.initialize() (never during graph capture or inside an
// execute handler) and zeroed, so every flag starts at epoch 0. Peers'
// workspaces are mapped into this process once: by peer access between local
// GPUs, or by IPC handles exchanged through the jax.distributed key-value
// store. FFI handlers cannot receive Python objects, so they find this state
// through Runtime::instance() by their device ordinal.
//
// Workspace layout: [trace counter, abort flag, trace switch | trace events | regions...]. Regions are
// placed by the Python side (jax_overlap/runtime.py) at offsets every rank of
// a group agrees on; each region has a host-side call counter (its epoch).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/params.h"
#include "platform/gpu.h"
#include "runtime/error_record.h"

namespace jo {

inline constexpr uint32_t kTraceCapacity = 1u << 16;  // events per GPU (2 MiB)
inline constexpr uint64_t kAbortFlagOffset = 64;  // Watchdog::abort
inline constexpr uint64_t kTraceEnabledOffset = 128;  // TraceSink::enabled
inline constexpr uint64_t kTraceEventsOffset = 256;
inline constexpr uint64_t kRegionsOffset =
    (kTraceEventsOffset + kTraceCapacity * sizeof(TraceEvent) + 4095) / 4096 * 4096;

// Empty message: success.
struct Status {
  std::string message;
  bool ok() const { return message.empty(); }
};

// "file:line: expr failed: <runtime message>" for any failing HIP/CUDA call.
#define JO_RETURN_IF_HIP_ERROR(expr)                                                                  \
  do {                                                                                                \
    const hipError_t jo_err_ = (expr);                                                                \
    if (jo_err_ != hipSuccess)                                                                        \
      return ::jo::Status{std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " #expr " failed: " + \
                          hipGetErrorString(jo_err_)};                                                \
  } while (0)

#define JO_RETURN_IF_ERROR(expr)            \
  do {                                      \
    ::jo::Status jo_status_ = (expr);       \
    if (!jo_status_.ok()) return jo_status_; \
  } while (0)

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

// The error of a call on a GPU without a workspace.
Status not_initialized(int ordinal);

// Everything this process knows about one of its GPUs.
struct Workspace {
  int ordinal = -1;
  int64_t global_id = -1;
  char* base = nullptr;
  uint64_t bytes = 0;
  ErrorRecord* error_host = nullptr;    // host-mapped pinned memory
  ErrorRecord* error_device = nullptr;  // the same, as the kernels address it
  DeviceInfo info;
  int ranks_per_gpu = 1;
  uint64_t timeout_ticks = 0;
  bool sync_after_launch = false;  // debugging: surface watchdog errors on the failing call
  std::map<int64_t, char*> peer_bases;  // global device id -> its workspace here (own included)
  std::vector<void*> ipc_mappings;
  std::map<uint64_t, std::unique_ptr<uint32_t>> epochs;  // region offset -> calls so far

  TraceSink trace_sink() const;
  uint32_t* abort_flag() const { return reinterpret_cast<uint32_t*>(base + kAbortFlagOffset); }
  LaunchLimits limits() const { return {info.sm_count, ranks_per_gpu, info.l2_bytes}; }
  uint32_t* epoch_counter(uint64_t region_offset);
};

// Where a call runs: its rank in the group and every rank's region.
struct GroupBinding {
  Workspace* ws = nullptr;
  Peers peers{};
  uint32_t* epoch = nullptr;  // nullptr when world == 1
};

class Runtime {
 public:
  static Runtime& instance();

  Status init_device(int ordinal, int64_t global_id, uint64_t bytes);
  Status set_options(int ordinal, double watchdog_seconds, bool sync_after_launch, bool trace);
  Status export_handle(int ordinal, std::string* handle);
  Status import_peer(int ordinal, int64_t peer_id, const std::string& handle);
  Status map_local_peer(int ordinal, int peer_ordinal);
  Status set_ranks_per_gpu(int ordinal, int ranks);
  Status read_trace(int ordinal, std::string* events, double* ticks_per_us);
  // Forgets a watchdog error on this GPU: the abort flag, then the record.
  Status clear_error(int ordinal);
  Status release();

  // nullptr when initialize() has not set this GPU up.
  Workspace* workspace(int ordinal);

  // Maps a call's `groups` attribute (world ids per group, groups
  // concatenated) to this device's rank and the group's regions.
  Status bind_group(int ordinal, const int64_t* groups, size_t n_ids, int world, uint64_t region_offset,
                    uint64_t region_bytes, GroupBinding* out);

 private:
  std::mutex mu_;
  std::map<int, std::unique_ptr<Workspace>> devices_;
};

// Forgets a watchdog error on GPU `ordinal`: its abort flag, then its
// host-mapped record (what lets calls launch again).
Status clear_watchdog(int ordinal, ErrorRecord* record, uint32_t* abort_flag);

// Non-empty when a kernel on this GPU recorded a watchdog timeout; the
// message names the op, the ranks and the flag.
std::string describe_error(const ErrorRecord& record, int64_t ticks_per_second);

}  // namespace jo
