// Bindings of the runtime (runtime/runtime.h) that jax_overlap/runtime/workspace.py
// drives: devices, workspaces, peers, the copy path, errors, traces.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "pipelined/copy.h"
#include "platform/device_scope.h"
#include "runtime/runtime.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace jo::bindings {
namespace {

py::object error_record(int ordinal) {
  Workspace* ws = Runtime::instance().workspace(ordinal);
  if (!ws) throw std::runtime_error("jax_overlap: GPU " + std::to_string(ordinal) + " has no workspace");
  const ErrorRecord& r = *ws->error_host;
  if (!error_recorded(r)) return py::none();
  py::dict d;
  d["op"] = op_name(r.op);
  d["rank"] = r.rank;
  d["peer"] = r.peer;
  d["world"] = r.world;
  d["epoch"] = r.epoch;
  d["waiting_for"] = wait_name(r.what);
  d["waited_seconds"] = static_cast<double>(r.waited_ticks) / static_cast<double>(ws->info.ticks_per_second);
  d["message"] = describe_error(r, ws->info.ticks_per_second);
  return d;
}

}  // namespace

void bind_runtime(py::module_& m) {
  m.attr("DEFAULT_WATCHDOG_SECONDS") = kDefaultWatchdogSeconds;

  m.def("workspace_peer_base", [](int ordinal, int64_t global_id) {
    Workspace* ws = Runtime::instance().workspace(ordinal);
    if (ws == nullptr || !ws->peer_bases.count(global_id))
      throw std::runtime_error("jax_overlap: device " + std::to_string(global_id) + " is not mapped on GPU " +
                               std::to_string(ordinal));
    return reinterpret_cast<uintptr_t>(ws->peer_bases.at(global_id));
  }, py::arg("ordinal"), py::arg("global_id"));
  m.def("device_info", [](int ordinal) {
    DeviceInfo info;
    throw_if_error(query_device(ordinal, &info));
    py::dict d;
    d["sm_count"] = info.sm_count;
    d["smem_per_block"] = info.smem_per_block;
    d["l2_bytes"] = info.l2_bytes;
    d["pci_bus_id"] = info.pci_bus_id;
    d["arch"] = info.arch;
    d["name"] = info.name;
    return d;
  }, py::arg("ordinal"));
  // Calls that allocate, synchronize or map memory release the GIL while they wait on the GPU.
  m.def("init_device", [](int ordinal, int64_t global_id) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().init_device(ordinal, global_id));
  }, py::arg("ordinal"), py::arg("global_id"));
  m.def("allocate_workspace", [](int ordinal, uint64_t bytes) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().allocate_workspace(ordinal, bytes));
  }, py::arg("ordinal"), py::arg("bytes"));
  m.def("set_options", [](int ordinal, double watchdog_seconds, bool sync_after_launch, bool trace) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().set_options(ordinal, watchdog_seconds, sync_after_launch, trace));
  }, py::arg("ordinal"), py::arg("watchdog_seconds"), py::arg("sync_after_launch"), py::arg("trace"));
  m.def("synchronize", [](int ordinal) {
    py::gil_scoped_release release;
    DeviceScope scope(ordinal);
    const hipError_t synced = scope.status() == hipSuccess ? hipDeviceSynchronize() : scope.status();
    if (synced != hipSuccess) throw std::runtime_error(std::string("jax_overlap: ") + hipGetErrorString(synced));
  }, py::arg("ordinal"));
  m.def(
      "set_abort_on_timeout", [](bool abort) { Runtime::instance().set_abort_on_timeout(abort); }, py::arg("abort"));
  m.def("generation", [] { return Runtime::instance().generation(); });
  m.def("export_handle", [](int ordinal) {
    std::string h;
    {
      py::gil_scoped_release release;
      throw_if_error(Runtime::instance().export_handle(ordinal, &h));
    }
    return py::bytes(h);
  }, py::arg("ordinal"));
  m.def("import_peer", [](int ordinal, int64_t peer_id, py::bytes handle) {
    const std::string h(handle);
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().import_peer(ordinal, peer_id, h));
  }, py::arg("ordinal"), py::arg("peer_id"), py::arg("handle"));
  m.def("map_local_peer", [](int ordinal, int peer_ordinal) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().map_local_peer(ordinal, peer_ordinal));
  }, py::arg("ordinal"), py::arg("peer_ordinal"));
  // After the peers are mapped: the GPU's copy path, verified on every mapped workspace (pipelined/copy.h).
  m.def("choose_copy_path", [](int ordinal) {
    pipelined::CopyPath chosen{};
    std::vector<std::string> rejected;
    {
      py::gil_scoped_release release;
      throw_if_error(Runtime::instance().choose_copy_path(ordinal, &chosen, &rejected));
    }
    return py::dict("path"_a = pipelined::copy_path_name(chosen),
                    "description"_a = pipelined::describe_copy_path(chosen), "rejected"_a = rejected);
  }, py::arg("ordinal"));
  m.def("set_ranks_per_gpu", [](int ordinal, int ranks) {
    throw_if_error(Runtime::instance().set_ranks_per_gpu(ordinal, ranks));
  }, py::arg("ordinal"), py::arg("ranks"));
  m.def("error_record", &error_record, py::arg("ordinal"));
  m.def("stop_after_error", [](int ordinal) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().stop_after_error(ordinal));
  }, py::arg("ordinal"));
  m.def("restart_after_error", [](int ordinal) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().restart_after_error(ordinal));
  }, py::arg("ordinal"));
  m.def("read_trace", [](int ordinal) {
    std::string events;
    double ticks_per_us = 0;
    {
      py::gil_scoped_release release;
      throw_if_error(Runtime::instance().read_trace(ordinal, &events, &ticks_per_us));
    }
    return py::make_tuple(py::bytes(events), ticks_per_us);
  }, py::arg("ordinal"));
  m.def("release", [] {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().release());
  });
}

}  // namespace jo::bindings
