#include "runtime/runtime.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "pipelined/streams.h"
#include "platform/device_scope.h"

namespace jo {
namespace {

// How often the monitor thread reads the error records (host-mapped: a read
// costs nothing on the GPU).
constexpr auto kMonitorPeriod = std::chrono::milliseconds(100);

}  // namespace

Status query_device(int ordinal, DeviceInfo* info) {
  hipDeviceProp_t prop;
  JO_RETURN_IF_HIP_ERROR(hipGetDeviceProperties(&prop, ordinal));
  JO_RETURN_IF_HIP_ERROR(hipDeviceGetAttribute(&info->sm_count, hipDeviceAttributeMultiprocessorCount, ordinal));
  JO_RETURN_IF_HIP_ERROR(
      hipDeviceGetAttribute(&info->smem_per_block, hipDeviceAttributeSharedMemPerBlockOptin, ordinal));
  int l2 = 0;
  JO_RETURN_IF_HIP_ERROR(hipDeviceGetAttribute(&l2, hipDeviceAttributeL2CacheSize, ordinal));
  info->l2_bytes = l2;
  char bus[64] = {0};
  JO_RETURN_IF_HIP_ERROR(hipDeviceGetPCIBusId(bus, sizeof(bus), ordinal));
  info->pci_bus_id = bus;
  info->arch = gpu::arch_name(prop);
  info->name = prop.name;
  info->ticks_per_second = gpu::timer_ticks_per_second(ordinal);
  return {};
}

uint64_t timeout_ticks(double seconds, int64_t ticks_per_second) {
  const double ticks = seconds * static_cast<double>(ticks_per_second);
  // 2^63 ticks are centuries on either vendor's timer: a bound that large, or infinite, never fires.
  return std::isfinite(ticks) && ticks < 9.2e18 ? static_cast<uint64_t>(ticks) : UINT64_MAX;
}

TraceSink Workspace::trace_sink() const {
  return TraceSink{reinterpret_cast<TraceEvent*>(header + kTraceEventsOffset), reinterpret_cast<uint32_t*>(header),
                   reinterpret_cast<const uint32_t*>(header + kTraceEnabledOffset), kTraceCapacity};
}

Status not_initialized(int ordinal) {
  return Status{"jax_overlap: GPU " + std::to_string(ordinal) +
                " is not set up; lower the call through jax (or call jax_overlap.initialize()) first"};
}

Runtime& Runtime::instance() {
  static Runtime* runtime = new Runtime();  // never destroyed: handlers may run during interpreter exit
  return *runtime;
}

Workspace* Runtime::workspace(int ordinal) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = devices_.find(ordinal);
  return it == devices_.end() ? nullptr : it->second.get();
}

Status Runtime::init_device(int ordinal, int64_t global_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (devices_.count(ordinal)) return {};
  auto ws = std::make_unique<Workspace>();
  ws->ordinal = ordinal;
  ws->global_id = global_id;
  JO_RETURN_IF_ERROR(query_device(ordinal, &ws->info));
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  void* header = nullptr;
  JO_RETURN_IF_HIP_ERROR(hipMalloc(&header, kHeaderBytes));
  ws->header = static_cast<char*>(header);
  JO_RETURN_IF_HIP_ERROR(hipMemset(header, 0, kHeaderBytes));
  void* record = nullptr;
  JO_RETURN_IF_HIP_ERROR(hipHostMalloc(&record, sizeof(ErrorRecord), hipHostMallocMapped));
  std::memset(record, 0, sizeof(ErrorRecord));
  ws->error_host = static_cast<ErrorRecord*>(record);
  void* record_device = nullptr;
  JO_RETURN_IF_HIP_ERROR(hipHostGetDevicePointer(&record_device, record, 0));
  ws->error_device = static_cast<ErrorRecord*>(record_device);
  JO_RETURN_IF_HIP_ERROR(hipDeviceSynchronize());
  ws->timeout_ticks = timeout_ticks(kDefaultWatchdogSeconds, ws->info.ticks_per_second);
  // The pipelined side streams and events, here rather than in a call's execute (pipelined/streams.h).
  JO_RETURN_IF_ERROR(pipelined::prepare_side_streams(ordinal));
  devices_[ordinal] = std::move(ws);
  start_monitor();
  return {};
}

Status Runtime::allocate_workspace(int ordinal, uint64_t bytes) {
  Workspace* ws = workspace(ordinal);
  if (!ws) return not_initialized(ordinal);
  if (ws->base != nullptr) {
    if (ws->bytes == bytes) return {};
    return Status{"jax_overlap: GPU " + std::to_string(ordinal) + " already has a workspace of " +
                  std::to_string(ws->bytes) + " bytes"};
  }
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  void* allocation = nullptr;
  JO_RETURN_IF_HIP_ERROR(gpu::malloc_peer_coherent(&allocation, pipelined::kCopyCheckBytes + bytes));
  ws->base = static_cast<char*>(allocation) + pipelined::kCopyCheckBytes;
  ws->bytes = bytes;
  // Zero once: every flag starts at epoch 0 and is never reset afterwards.
  JO_RETURN_IF_HIP_ERROR(hipMemset(ws->base, 0, bytes));
  // The copy self-test's pattern, before the regions (where a peer finds it
  // without knowing this workspace's size). It is complete (the synchronize
  // below) before export_handle() can give the workspace to any peer, and
  // nothing writes it again (regions start after it; clear_errors() zeroes
  // the regions only): peers read it with no barrier (choose_copy_path).
  JO_RETURN_IF_HIP_ERROR(pipelined::fill_copy_pattern(allocation, ws->global_id, nullptr));
  JO_RETURN_IF_HIP_ERROR(hipDeviceSynchronize());
  ws->peer_bases[ws->global_id] = ws->base;
  return {};
}

Status Runtime::set_options(int ordinal, double watchdog_seconds, bool sync_after_launch, bool trace) {
  Workspace* ws = workspace(ordinal);
  if (!ws) return not_initialized(ordinal);
  if (!(watchdog_seconds > 0)) return Status{"jax_overlap: watchdog_seconds must be positive"};
  ws->timeout_ticks = timeout_ticks(watchdog_seconds, ws->info.ticks_per_second);
  ws->sync_after_launch = sync_after_launch;
  // Kernels read the switch from device memory (TraceSink::enabled).
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  const uint32_t on = trace ? 1u : 0u;
  JO_RETURN_IF_HIP_ERROR(hipMemcpy(ws->header + kTraceEnabledOffset, &on, sizeof(on), hipMemcpyHostToDevice));
  return {};
}

void Runtime::set_abort_on_timeout(bool abort) { abort_on_timeout_.store(abort, std::memory_order_release); }

void Runtime::start_monitor() {
  if (monitor_started_) return;  // mu_ held
  monitor_started_ = true;
  // NCCL's watchdog does the same: a timed-out collective leaves its group out
  // of step, so the process ends with the error record printed (the outputs
  // of the call are NaN already; this keeps them from being used at all).
  std::thread([this] {
    for (;;) {
      std::this_thread::sleep_for(kMonitorPeriod);
      if (!abort_on_timeout_.load(std::memory_order_acquire)) continue;
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [ordinal, ws] : devices_) {
        if (!error_recorded(*ws->error_host)) continue;
        std::fprintf(stderr, "%s\njax_overlap: aborting the process (JAX_OVERLAP_ON_TIMEOUT=abort).\n",
                     describe_error(*ws->error_host, ws->info.ticks_per_second).c_str());
        std::fflush(stderr);
        std::abort();
      }
    }
  }).detach();
}

Status Runtime::export_handle(int ordinal, std::string* handle) {
  Workspace* ws = workspace(ordinal);
  if (!ws || !ws->base) return not_initialized(ordinal);
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  hipIpcMemHandle_t h;
  JO_RETURN_IF_HIP_ERROR(hipIpcGetMemHandle(&h, ws->base - pipelined::kCopyCheckBytes));  // the allocation
  handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return {};
}

Status Runtime::import_peer(int ordinal, int64_t peer_id, const std::string& handle) {
  Workspace* ws = workspace(ordinal);
  if (!ws || !ws->base) return not_initialized(ordinal);
  if (handle.size() != sizeof(hipIpcMemHandle_t))
    return Status{"jax_overlap: IPC handle of device " + std::to_string(peer_id) + " has " +
                  std::to_string(handle.size()) + " bytes, expected " + std::to_string(sizeof(hipIpcMemHandle_t))};
  if (ws->peer_bases.count(peer_id)) return {};
  hipIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  void* mapped = nullptr;
  JO_RETURN_IF_HIP_ERROR(hipIpcOpenMemHandle(&mapped, h, hipIpcMemLazyEnablePeerAccess));
  ws->ipc_mappings.push_back(mapped);
  ws->peer_bases[peer_id] = static_cast<char*>(mapped) + pipelined::kCopyCheckBytes;
  return {};
}

Status Runtime::map_local_peer(int ordinal, int peer_ordinal) {
  Workspace* ws = workspace(ordinal);
  Workspace* peer = workspace(peer_ordinal);
  if (!ws || !ws->base) return not_initialized(ordinal);
  if (!peer || !peer->base) return not_initialized(peer_ordinal);
  if (ordinal != peer_ordinal) {
    int can = 0;
    JO_RETURN_IF_HIP_ERROR(hipDeviceCanAccessPeer(&can, ordinal, peer_ordinal));
    if (!can)
      return Status{"jax_overlap: GPU " + std::to_string(ordinal) + " cannot access GPU " +
                    std::to_string(peer_ordinal) + " (no peer-to-peer path)"};
    DeviceScope scope(ordinal);
    JO_RETURN_IF_HIP_ERROR(scope.status());
    const hipError_t e = hipDeviceEnablePeerAccess(peer_ordinal, 0);
    if (e == hipErrorPeerAccessAlreadyEnabled) {
      (void)hipGetLastError();  // clear the sticky "already enabled" status
    } else {
      JO_RETURN_IF_HIP_ERROR(e);
    }
  }
  ws->peer_bases[peer->global_id] = peer->base;
  return {};
}

Status Runtime::choose_copy_path(int ordinal, pipelined::CopyPath* chosen, std::vector<std::string>* rejected) {
  Workspace* ws = workspace(ordinal);
  if (!ws || !ws->base) return not_initialized(ordinal);
  ws->copy_path.store(-1, std::memory_order_release);
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  struct Scratch {  // the test's destinations and stream, freed at scope exit unless a copy stalled on them
    void* memory = nullptr;     // like the buffers XLA gives a call (gathered, the received partials)
    void* workspace = nullptr;  // like the workspace (x's published slot)
    hipStream_t stream = nullptr;
    bool stalled = false;
    ~Scratch() {
      if (stalled) return;  // freeing would wait for the stalled copy
      if (stream) {
        (void)hipStreamSynchronize(stream);
        (void)hipStreamDestroy(stream);
      }
      if (memory) (void)hipFree(memory);
      if (workspace) (void)hipFree(workspace);
    }
  } t;
  JO_RETURN_IF_HIP_ERROR(hipMalloc(&t.memory, pipelined::kCopyCheckScratchBytes));
  JO_RETURN_IF_HIP_ERROR(gpu::malloc_peer_coherent(&t.workspace, pipelined::kCopyCheckScratchBytes));
  JO_RETURN_IF_HIP_ERROR(hipStreamCreateWithFlags(&t.stream, hipStreamNonBlocking));
  // The schedule's copies: pulls from every mapped workspace into this GPU's memory, and local copies
  // between its memory and its own workspace (the own workspace's pattern into both kinds of memory).
  struct Copy {
    int64_t owner;
    const char* pattern;
    void* into;
  };
  std::vector<Copy> copies;
  for (const auto& [id, base] : ws->peer_bases) {
    copies.push_back({id, base - pipelined::kCopyCheckBytes, t.memory});
    if (id == ws->global_id) copies.push_back({id, base - pipelined::kCopyCheckBytes, t.workspace});
  }
  // Bounded by the watchdog, as every wait on a GPU is (infinite when the watchdog is).
  const double timeout_seconds = ws->timeout_ticks == UINT64_MAX
                                     ? HUGE_VAL
                                     : static_cast<double>(ws->timeout_ticks) / ws->info.ticks_per_second;
  rejected->clear();
  for (pipelined::CopyPath path : pipelined::kCopyPaths) {
    std::string failed;
    for (const Copy& c : copies) {
      // A copy call that fails fails the path, not the test; one that never finishes ends it (the GPU's
      // queues may be stuck behind it).
      uint64_t wrong = 0;
      const Status s = pipelined::check_copy_path(path, c.pattern, c.owner, static_cast<char*>(c.into), t.stream,
                                                  timeout_seconds, &wrong, &t.stalled);
      if (t.stalled) {
        char seconds[32];
        std::snprintf(seconds, sizeof(seconds), "%.3g", timeout_seconds);
        return Status{"jax_overlap: the copy self-test on GPU " + std::to_string(ordinal) + " (" +
                      pipelined::describe_copy_path(path) + ", from device " + std::to_string(c.owner) +
                      ") did not finish within the watchdog's " + seconds +
                      " s: a stalled copy engine (as MI308X's fused-off SDMA engines stall, ROCm/mori #693); "
                      "restart the process"};
      }
      if (!s.ok()) (void)hipGetLastError();
      if (!s.ok() || wrong != 0)
        failed += std::string(failed.empty() ? "" : "; ") + "from device " + std::to_string(c.owner) +
                  (c.into == t.workspace ? " into its workspace" : "") + ": " +
                  (s.ok() ? "bytes did not land (" + std::to_string(wrong) + " of " +
                                std::to_string(pipelined::kCopyCheckBytes / 4) + " words checked were wrong)"
                          : s.message);
    }
    if (failed.empty()) {
      ws->copy_path.store(static_cast<int>(path), std::memory_order_release);
      *chosen = path;
      return {};
    }
    rejected->push_back(pipelined::describe_copy_path(path) + " failed its self-test (" + failed + ")");
  }
  std::string why;
  for (const std::string& r : *rejected) why += "; " + r;
  return Status{"jax_overlap: no copy path moves bytes right on GPU " + std::to_string(ordinal) + why};
}

Status Runtime::verified_copy_path(const Workspace& ws, pipelined::CopyPath* out) {
  const int path = ws.copy_path.load(std::memory_order_acquire);
  if (path < 0)
    return Status{"jax_overlap: GPU " + std::to_string(ws.ordinal) +
                  " has no verified copy path; jax_overlap.initialize() verifies one before pipelined calls run"};
  *out = static_cast<pipelined::CopyPath>(path);
  return {};
}

Status Runtime::set_ranks_per_gpu(int ordinal, int ranks) {
  Workspace* ws = workspace(ordinal);
  if (!ws) return not_initialized(ordinal);
  ws->ranks_per_gpu = ranks < 1 ? 1 : ranks;
  return {};
}

Status Runtime::read_trace(int ordinal, std::string* events, double* ticks_per_us) {
  Workspace* ws = workspace(ordinal);
  if (!ws) return not_initialized(ordinal);
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  JO_RETURN_IF_HIP_ERROR(hipDeviceSynchronize());
  uint32_t count = 0;
  JO_RETURN_IF_HIP_ERROR(hipMemcpy(&count, ws->header, sizeof(count), hipMemcpyDeviceToHost));
  const uint32_t kept = count < kTraceCapacity ? count : kTraceCapacity;
  events->resize(static_cast<size_t>(kept) * sizeof(TraceEvent));
  if (kept)
    JO_RETURN_IF_HIP_ERROR(
        hipMemcpy(events->data(), ws->header + kTraceEventsOffset, events->size(), hipMemcpyDeviceToHost));
  JO_RETURN_IF_HIP_ERROR(hipMemset(ws->header, 0, sizeof(uint32_t)));
  *ticks_per_us = static_cast<double>(ws->info.ticks_per_second) / 1e6;
  return {};
}

Status clear_watchdog(int ordinal, ErrorRecord* record, uint32_t* abort_flag) {
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  // Kernels launched before the error surfaced saw the flag and left; once
  // they are done, zero it before the record lets new calls start.
  JO_RETURN_IF_HIP_ERROR(hipDeviceSynchronize());
  JO_RETURN_IF_HIP_ERROR(hipMemset(abort_flag, 0, sizeof(uint32_t)));
  JO_RETURN_IF_HIP_ERROR(hipDeviceSynchronize());
  std::memset(record, 0, sizeof(ErrorRecord));
  return {};
}

Status Runtime::stop_after_error(int ordinal) {
  Workspace* ws = workspace(ordinal);
  if (ws == nullptr) return {};
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  // Every wait still spinning here (on a peer that will never answer) leaves
  // once it reads the abort flag; then nothing of this GPU's runs any more.
  const uint32_t one = 1;
  JO_RETURN_IF_HIP_ERROR(hipMemcpy(ws->abort_flag(), &one, sizeof(one), hipMemcpyHostToDevice));
  JO_RETURN_IF_HIP_ERROR(hipDeviceSynchronize());
  return {};
}

Status Runtime::restart_after_error(int ordinal) {
  Workspace* ws = workspace(ordinal);
  if (ws == nullptr) return {};
  if (error_recorded(*ws->error_host) && static_cast<WaitOn>(ws->error_host->what) == WaitOn::kTailPartial)
    return Status{describe_error(*ws->error_host, ws->info.ticks_per_second)};
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  if (ws->base != nullptr) JO_RETURN_IF_HIP_ERROR(hipMemset(ws->base, 0, ws->bytes));
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [offset, counter] : ws->epochs) counter->restart(epoch_origin_);
  }
  return clear_watchdog(ordinal, ws->error_host, ws->abort_flag());
}

Status Runtime::release() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [ordinal, ws] : devices_) {
    DeviceScope scope(ordinal);
    JO_RETURN_IF_HIP_ERROR(hipDeviceSynchronize());
    pipelined::release_side_streams(ordinal);
    for (void* p : ws->ipc_mappings) JO_RETURN_IF_HIP_ERROR(hipIpcCloseMemHandle(p));
    if (ws->base != nullptr) JO_RETURN_IF_HIP_ERROR(hipFree(ws->base - pipelined::kCopyCheckBytes));
    JO_RETURN_IF_HIP_ERROR(hipFree(ws->header));
    JO_RETURN_IF_HIP_ERROR(hipHostFree(ws->error_host));
  }
  devices_.clear();
  generation_.fetch_add(1, std::memory_order_acq_rel);
  return {};
}

void Runtime::set_epoch_origin(uint64_t origin) {
  std::lock_guard<std::mutex> lock(mu_);
  epoch_origin_ = origin;
}

Status Runtime::bind_group(int ordinal, const int64_t* groups, size_t n_ids, int world, uint64_t region_offset,
                           uint64_t region_bytes, GroupBinding* out) {
  Workspace* ws = workspace(ordinal);
  if (!ws) return not_initialized(ordinal);
  if (world < 1 || world > kMaxWorld || n_ids % static_cast<size_t>(world) != 0)
    return Status{"jax_overlap: group size " + std::to_string(world) + " is not in [1, " +
                  std::to_string(kMaxWorld) + "] or does not divide the " + std::to_string(n_ids) + " group ids"};
  long first = -1;
  for (size_t i = 0; i < n_ids; ++i)
    if (groups[i] == ws->global_id) first = static_cast<long>(i);
  if (world > 1 && first < 0)
    return Status{"jax_overlap: device " + std::to_string(ws->global_id) + " is in none of the call's groups"};
  out->ws = ws;
  out->peers = Peers{};
  out->peers.world = world;
  out->peers.rank = world > 1 ? static_cast<int>(first % world) : 0;
  out->epochs = nullptr;
  if (world == 1) return {};
  if (ws->base == nullptr) return Status{"jax_overlap: GPU " + std::to_string(ordinal) + " has no symmetric workspace"};
  if (region_offset + region_bytes > ws->bytes)
    return Status{"jax_overlap: region [" + std::to_string(region_offset) + ", +" + std::to_string(region_bytes) +
                  ") does not fit the workspace of " + std::to_string(ws->bytes) + " bytes"};
  const size_t group_start = static_cast<size_t>(first / world) * world;
  for (int r = 0; r < world; ++r) {
    const int64_t id = groups[group_start + r];
    auto it = ws->peer_bases.find(id);
    if (it == ws->peer_bases.end())
      return Status{"jax_overlap: device " + std::to_string(id) + " (rank " + std::to_string(r) +
                    ") is not reachable from device " + std::to_string(ws->global_id) +
                    "; jax_overlap.initialize() maps peers on the same host only"};
    out->peers.regions[r] = it->second + region_offset;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto& counter = ws->epochs[region_offset];
  if (!counter) {
    counter = std::make_unique<EpochCounter>();
    counter->restart(epoch_origin_);
  }
  out->epochs = counter.get();
  return {};
}

std::string describe_error(const ErrorRecord& r, int64_t ticks_per_second) {
  // snprintf, not iostreams: this runs on error paths where nothing else should go wrong.
  char text[640];
  if (static_cast<WaitOn>(r.what) == WaitOn::kCallSite) {
    std::snprintf(text, sizeof(text),
                  "jax_overlap: %s on rank %u of %u found rank %u's release of epoch %u made by another call site "
                  "sharing the region: the ranks ran their jax_overlap calls in different orders (no data was "
                  "used). Fused and pipelined calls on this GPU fail until jax_overlap.clear_errors().",
                  op_name(r.op), r.rank, r.world, r.peer, r.epoch);
    return text;
  }
  if (static_cast<WaitOn>(r.what) == WaitOn::kOverwritten) {
    std::snprintf(text, sizeof(text),
                  "jax_overlap: %s on rank %u of %u: rank %u rewrote the data it had released for epoch %u while "
                  "this rank was still reading it: rank %u had given up on an earlier call (its watchdog fired, or a "
                  "call failed) and its queued calls went on. The data read is lost: the call's outputs are NaN, and "
                  "fused and pipelined calls on this GPU fail until jax_overlap.clear_errors().",
                  op_name(r.op), r.rank, r.world, r.peer, r.epoch, r.peer);
    return text;
  }
  if (static_cast<WaitOn>(r.what) == WaitOn::kPeerAbandoned) {
    std::snprintf(text, sizeof(text),
                  "jax_overlap: %s on rank %u of %u: rank %u abandoned epoch %u: it could not enqueue its part of "
                  "the call, or refused it after an earlier error (that rank's error says why). The call's outputs "
                  "are NaN, and fused and pipelined calls on this GPU fail until jax_overlap.clear_errors().",
                  op_name(r.op), r.rank, r.world, r.peer, r.epoch);
    return text;
  }
  if (static_cast<WaitOn>(r.what) == WaitOn::kEnqueueFailed) {
    std::snprintf(text, sizeof(text),
                  "jax_overlap: %s on rank %u of %u could not enqueue its part of epoch %u and abandoned it, so that "
                  "its peers' calls of that epoch fail at once (the call's own error said why). Fused and pipelined "
                  "calls on this GPU fail until jax_overlap.clear_errors().",
                  op_name(r.op), r.rank, r.world, r.epoch);
    return text;
  }
  if (static_cast<WaitOn>(r.what) == WaitOn::kTailPartial) {
    std::snprintf(text, sizeof(text),
                  "jax_overlap: %s (a group of one) waited %.3g s for a stream-K tail piece of its own launch: a "
                  "bug in jax_overlap, or other work on the GPU kept the launch's workgroups from running together. "
                  "The call's output is NaN and every jax_overlap call on this GPU fails; restart the process "
                  "(the late piece may still land in XLA's scratch, so clear_errors() cannot restart this GPU).",
                  op_name(r.op), static_cast<double>(r.waited_ticks) / static_cast<double>(ticks_per_second));
    return text;
  }
  std::snprintf(text, sizeof(text),
                "jax_overlap: %s on rank %u of %u timed out after %.3g s waiting for rank %u (%s, epoch %u); "
                "the peer is stalled or gone. The call's outputs are NaN, and fused and pipelined calls on this GPU "
                "fail until jax_overlap.clear_errors().",
                op_name(r.op), r.rank, r.world,
                static_cast<double>(r.waited_ticks) / static_cast<double>(ticks_per_second), r.peer,
                wait_name(r.what), r.epoch);
  return text;
}

}  // namespace jo
