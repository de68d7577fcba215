// Python module jax_overlap._native: FFI registrations, build info, the
// runtime's entry points (jax_overlap/runtime.py drives them) and the
// simulated-rank harness used by the GPU tests and benchmarks.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "blas/capture_check.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/ag_matmul.h"
#include "kernels/all_gather.h"
#include "kernels/matmul_rs.h"
#include "kernels/pipeline_kernels.h"
#include "kernels/region_layout.h"
#include "pipelined/copy.h"
#include "pipelined/measure.h"
#include "pipelined/schedule.h"
#include "platform/gpu.h"
#include "runtime/faults.h"
#include "runtime/runtime.h"
#include "runtime/sim_group.h"

namespace py = pybind11;
using namespace pybind11::literals;

#ifndef JAX_OVERLAP_ARCHS
#define JAX_OVERLAP_ARCHS "unknown"
#endif
#ifndef JAX_OVERLAP_COMPILER
#define JAX_OVERLAP_COMPILER "unknown"
#endif
#ifndef JAX_OVERLAP_FFI_API
#define JAX_OVERLAP_FFI_API "unknown"
#endif

namespace jo {
namespace {

void throw_if_error(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message);
}

py::capsule capsule(XLA_FFI_Handler* fn) { return py::capsule(reinterpret_cast<void*>(fn)); }

py::dict tile_shape_dict(int index) {
  TileShapeInfo info{};
  if (!tile_shape_info(index, &info)) throw std::out_of_range("no tile shape " + std::to_string(index));
  return py::dict("index"_a = index, "bm"_a = info.bm, "bn"_a = info.bn, "bk"_a = info.bk,
                  "threads"_a = info.threads, "smem_bytes"_a = info.smem_bytes, "stream_k"_a = info.stream_k,
                  "arch"_a = info.arch);
}

// The launch of one fused GEMM call (kernels/launch.h gemm_geometry), for
// jax_overlap/config.py. m: ag_matmul's local rows, matmul_rs's total rows
// (per batch element). workgroups_per_sm == 0: the kernel's occupancy on the
// current device.
py::dict gemm_geometry(const std::string& op, int tile, const std::string& dtype, bool w_kmajor, int world,
                       int64_t batch, int64_t m, int64_t k, int64_t n, int chunk_k, int comm_workgroups, int sm_count,
                       int ranks_per_gpu, int64_t l2_bytes, int workgroups_per_sm) {
  GemmOperands operands{};
  operands.dtype = dtype == "bfloat16" ? DType::kBF16 : DType::kF16;
  operands.tile = tile;
  operands.w_kmajor = w_kmajor;
  operands.batch = batch;
  operands.k = k;
  operands.n = n;
  operands.comm_workgroups = comm_workgroups;
  CallContext ctx{};
  ctx.peers.world = world;
  ctx.limits = LaunchLimits{sm_count, ranks_per_gpu, l2_bytes};
  GemmGeometry g{};
  hipError_t e = hipErrorInvalidValue;
  if (op == "ag_matmul") {
    AgMatmulLaunch l{};
    l.op = operands;
    l.m = m;
    l.chunk_k = chunk_k;
    l.ctx = ctx;
    e = ag_matmul_geometry(l, workgroups_per_sm, &g);
  } else if (op == "matmul_rs") {
    MatmulRsLaunch l{};
    l.op = operands;
    l.m_total = m;
    l.ctx = ctx;
    e = matmul_rs_geometry(l, workgroups_per_sm, &g);
  }
  if (e != hipSuccess && g.workgroups_per_sm == 0)
    throw std::invalid_argument("jax_overlap: no geometry for " + op + " with tile " + std::to_string(tile) + ": " +
                                hipGetErrorString(e));
  return py::dict("workgroups_per_sm"_a = g.workgroups_per_sm, "co_resident"_a = g.co_resident,
                  "comm_workgroups"_a = g.comm_workgroups, "grid"_a = g.grid, "tiles"_a = g.tiles,
                  "group_cols"_a = g.group_cols, "tail_slots"_a = g.tail_slots,
                  "tail_scratch_bytes"_a = g.tail_scratch_bytes, "region_bytes"_a = g.region_bytes,
                  "launchable"_a = e == hipSuccess);
}

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

SimMatmul sim_call(py::dict c) {
  SimMatmul s{};
  s.dtype = c["dtype"].cast<std::string>() == "bfloat16" ? DType::kBF16 : DType::kF16;
  s.tile = c["tile"].cast<int>();
  s.comm_workgroups = c["comm_workgroups"].cast<int>();
  s.chunk_k = c.contains("chunk_k") ? c["chunk_k"].cast<int>() : 0;
  s.w_kmajor = c["w_kmajor"].cast<bool>();
  s.batch = c["batch"].cast<int64_t>();
  s.m = c["m"].cast<int64_t>();
  s.k = c["k"].cast<int64_t>();
  s.n = c["n"].cast<int64_t>();
  s.x = c["x"].cast<std::vector<uintptr_t>>();
  s.w = c["w"].cast<std::vector<uintptr_t>>();
  s.bias = c["bias"].cast<std::vector<uintptr_t>>();
  s.out = c["out"].cast<std::vector<uintptr_t>>();
  if (c.contains("gathered")) s.gathered = c["gathered"].cast<std::vector<uintptr_t>>();
  if (c.contains("scratch")) s.scratch = c["scratch"].cast<std::vector<uintptr_t>>();
  if (c.contains("stages")) s.stages = c["stages"].cast<std::vector<int64_t>>();
  if (c.contains("site")) s.site = c["site"].cast<uint32_t>();
  if (c.contains("ranks")) s.ranks = c["ranks"].cast<std::vector<int>>();
  if (c.contains("sync")) s.sync = c["sync"].cast<bool>();
  return s;
}

DType dtype_of(const std::string& name) {
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kF16;
  throw std::invalid_argument("jax_overlap: the pipelined algorithm takes bfloat16 or float16, got " + name);
}

OpKind op_of(const std::string& name) {
  if (name == "ag_matmul") return OpKind::kAgMatmul;
  if (name == "matmul_rs") return OpKind::kMatmulRs;
  throw std::invalid_argument("jax_overlap: no op " + name);
}

// A loopback call of the op (pipelined/schedule.h) from a dict of device pointers and sizes.
pipelined::Operands loopback_operands(py::dict c, std::vector<int64_t>* stages) {
  pipelined::Operands o{};
  o.dtype = dtype_of(c["dtype"].cast<std::string>());
  o.x = reinterpret_cast<const void*>(c["x"].cast<uintptr_t>());
  o.w = reinterpret_cast<const void*>(c["w"].cast<uintptr_t>());
  o.bias = reinterpret_cast<const void*>(c["bias"].cast<uintptr_t>());
  o.out = reinterpret_cast<void*>(c["out"].cast<uintptr_t>());
  o.gathered = reinterpret_cast<void*>(c.contains("gathered") ? c["gathered"].cast<uintptr_t>() : 0);
  o.scratch = reinterpret_cast<void*>(c["scratch"].cast<uintptr_t>());
  o.batch = c["batch"].cast<int64_t>();
  o.m = c["m"].cast<int64_t>();
  o.k = c["k"].cast<int64_t>();
  o.n = c["n"].cast<int64_t>();
  o.w_kmajor = c["w_kmajor"].cast<bool>();
  *stages = c["stages"].cast<std::vector<int64_t>>();
  o.stages = stages->data();
  o.stage_count = static_cast<int>(stages->size());
  return o;
}

// The copy path a timing or test names ("copy_engine", ...); none: the path initialize() verified on the
// GPU, or before it did, the first candidate (calibration's guess of the link precedes initialize()).
pipelined::CopyPath copy_path_of(int ordinal, const std::optional<std::string>& name) {
  pipelined::CopyPath path = pipelined::kCopyPaths[0];
  if (name) {
    if (!pipelined::parse_copy_path(*name, &path))
      throw std::invalid_argument("jax_overlap: no copy path " + *name + "; the paths are copy_engine, "
                                  "device_to_device and kernel");
    return path;
  }
  const Workspace* ws = Runtime::instance().workspace(ordinal);
  if (ws != nullptr) (void)Runtime::verified_copy_path(*ws, &path);
  return path;
}

}  // namespace
}  // namespace jo

PYBIND11_MODULE(_native, m) {
  using namespace jo;
  m.doc() = "jax_overlap native extension: FFI handlers, runtime, simulated ranks";

  m.def("build_info", [] {
    py::dict d;
    d["platform"] = gpu::kPlatformName;
    d["archs"] = JAX_OVERLAP_ARCHS;
    d["compiler"] = JAX_OVERLAP_COMPILER;
    d["ffi_api"] = JAX_OVERLAP_FFI_API;
    d["fused_kernels"] = true;
    return d;
  });
  m.attr("MAX_WORLD") = kMaxWorld;
  m.attr("DEFAULT_WATCHDOG_SECONDS") = kDefaultWatchdogSeconds;

  m.def("targets", [] {
    py::dict d;
    for (const FfiTarget& t : ffi_targets()) d[t.op] = t.target;
    return d;
  });
  m.def("registrations", [] {
    py::dict d;
    for (const FfiTarget& t : ffi_targets()) {
      py::dict stages;
      if (t.instantiate != nullptr) stages["instantiate"] = capsule(t.instantiate);
      stages["execute"] = capsule(t.execute);
      d[t.target] = stages;
    }
    return d;
  });
  m.def("type_registrations", [] {
    py::dict reg;
    reg["type_id"] = py::capsule(reinterpret_cast<void*>(&CallState::id));
    reg["type_info"] = py::capsule(const_cast<void*>(reinterpret_cast<const void*>(&kCallStateTypeInfo)));
    py::dict d;
    d["jax_overlap_call_state"] = reg;
    return d;
  });
  m.def("tile_shapes", [] {
    py::list out;
    for (int i = 0; i < tile_shape_count(); ++i) out.append(tile_shape_dict(i));
    return out;
  });

  m.def("ag_matmul_region_bytes", &ag_matmul_region_bytes, py::arg("world"), py::arg("rows"), py::arg("k"),
        py::arg("tile"), py::arg("chunk_k"), py::arg("elem_bytes"));
  m.def("tail_scratch_bytes", &tail_scratch_bytes, py::arg("tile"), py::arg("slots"));
  m.def("gemm_geometry", &gemm_geometry, py::arg("op"), py::arg("tile"), py::arg("dtype"), py::arg("w_kmajor"),
        py::arg("world"), py::arg("batch"), py::arg("m"), py::arg("k"), py::arg("n"), py::arg("chunk_k"),
        py::arg("comm_workgroups"), py::arg("sm_count"), py::arg("ranks_per_gpu"), py::arg("l2_bytes"),
        py::arg("workgroups_per_sm") = 0);
  m.def("matmul_rs_region_bytes", &matmul_rs_region_bytes, py::arg("world"), py::arg("batch"),
        py::arg("m_total"), py::arg("n"), py::arg("tile"), py::arg("elem_bytes"));
  m.def("all_gather_region_bytes", &all_gather_region_bytes, py::arg("world"), py::arg("rows"),
        py::arg("row_bytes"));
  m.def(
      "pipelined_region_bytes",
      [](const std::string& op, int world, int64_t batch, int64_t m, int64_t k, int64_t n, int elem_bytes) {
        return pipelined::region_bytes(op_of(op), world, batch, m, k, n, elem_bytes);
      },
      py::arg("op"), py::arg("world"), py::arg("batch"), py::arg("m"), py::arg("k"), py::arg("n"),
      py::arg("elem_bytes"));
  m.def(
      "pipelined_scratch_bytes",
      [](const std::string& op, int world, int64_t batch, int64_t m, int64_t n, int elem_bytes, bool loopback) {
        return pipelined::scratch_bytes(op_of(op), world, batch, m, n, elem_bytes, loopback);
      },
      py::arg("op"), py::arg("world"), py::arg("batch"), py::arg("m"), py::arg("n"), py::arg("elem_bytes"),
      py::arg("loopback") = false);
  m.def(
      "check_stages",
      [](const std::string& op, int world, std::vector<int64_t> stages) {
        throw_if_error(pipelined::check_stages(op_of(op), world, stages.data(), static_cast<int>(stages.size())));
      },
      py::arg("op"), py::arg("world"), py::arg("stages"));
  // Loads the vendor BLAS on GPU `ordinal` and runs its capture check (blas/capture_check.h) once.
  m.def("prepare_vendor_blas", [](int ordinal) {
    blas::CaptureCheck check;
    {
      py::gil_scoped_release release;
      blas::DeviceBlas* blas = nullptr;
      throw_if_error(blas::DeviceBlas::get(ordinal, &blas));
      throw_if_error(blas::check_graph_capture(ordinal, &check));
    }
    return py::dict("graph_safe"_a = check.graph_safe, "detail"_a = check.detail,
                    "checked_now"_a = check.checked_now);
  });
  m.def("vendor_gemm_graph_safe", &blas::graph_capture_safe);
  m.def(
      "time_gemms",
      [](int ordinal, const std::string& dtype, std::vector<int64_t> rows, int64_t n, int64_t k, bool w_kmajor,
         int repeats, double warmup_ms) {
        std::vector<double> us;
        py::gil_scoped_release release;
        throw_if_error(
            pipelined::time_gemms(ordinal, dtype_of(dtype), rows, n, k, w_kmajor, repeats, warmup_ms, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("dtype"), py::arg("rows"), py::arg("n"), py::arg("k"), py::arg("w_kmajor") = false,
      py::arg("repeats") = 5, py::arg("warmup_ms") = 0.0);
  // piece_bytes 0: the cap in force (pipelined::max_copy_bytes); path None: copy_path_of.
  m.def(
      "time_copy",
      [](int ordinal, uintptr_t src, uint64_t bytes, int repeats, std::optional<std::string> path,
         uint64_t piece_bytes) {
        const pipelined::CopyPath p = copy_path_of(ordinal, path);
        const uint64_t pieces = piece_bytes != 0 ? piece_bytes : pipelined::max_copy_bytes();
        double us = 0;
        py::gil_scoped_release release;
        throw_if_error(
            pipelined::time_copy(ordinal, reinterpret_cast<const void*>(src), bytes, repeats, p, pieces, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("src"), py::arg("bytes"), py::arg("repeats") = 5, py::arg("path") = py::none(),
      py::arg("piece_bytes") = 0);
  m.attr("MAX_COPY_BYTES") = pipelined::kMaxCopyBytes;
  m.def("max_copy_bytes", &pipelined::max_copy_bytes);
  m.def("copy_paths", [] {
    py::list names;
    for (pipelined::CopyPath p : pipelined::kCopyPaths) names.append(pipelined::copy_path_name(p));
    return names;
  });
  m.def(
      "copy_pieces",
      [](uint64_t width, uint64_t height, uint64_t max_bytes) {
        py::list out;
        for (const pipelined::CopyPiece& p : pipelined::copy_pieces(width, height, max_bytes))
          out.append(py::make_tuple(p.row, p.offset, p.width, p.height));
        return out;
      },
      py::arg("width"), py::arg("height"), py::arg("max_bytes"));
  // Tests: one 2-D copy on `path` on a stream of its own, waited for (max_bytes 0: the cap in force).
  m.def(
      "copy_2d",
      [](int ordinal, const std::string& path, uintptr_t dst, uint64_t dst_pitch, uintptr_t src, uint64_t src_pitch,
         uint64_t width, uint64_t height, uint64_t max_bytes) {
        const pipelined::CopyPath p = copy_path_of(ordinal, path);
        py::gil_scoped_release release;
        throw_if_error(pipelined::copy_and_wait(ordinal, p, reinterpret_cast<void*>(dst), dst_pitch,
                                                reinterpret_cast<const void*>(src), src_pitch, width, height,
                                                max_bytes != 0 ? max_bytes : pipelined::max_copy_bytes()));
      },
      py::arg("ordinal"), py::arg("path"), py::arg("dst"), py::arg("dst_pitch"), py::arg("src"), py::arg("src_pitch"),
      py::arg("width"), py::arg("height"), py::arg("max_bytes") = 0);
  m.def(
      "time_reduce",
      [](int ordinal, const std::string& dtype, int count, int64_t rows, int64_t n, int repeats) {
        double us = 0;
        py::gil_scoped_release release;
        throw_if_error(pipelined::time_reduce(ordinal, dtype_of(dtype), count, rows, n, repeats, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("dtype"), py::arg("count"), py::arg("rows"), py::arg("n"), py::arg("repeats") = 5);
  m.def(
      "time_loopback",
      [](int ordinal, const std::string& op, int world, py::dict call, int repeats, std::optional<std::string> path) {
        std::vector<int64_t> stages;
        const pipelined::Operands o = loopback_operands(call, &stages);
        const pipelined::CopyPath p = copy_path_of(ordinal, path);
        double us = 0;
        py::gil_scoped_release release;
        throw_if_error(pipelined::time_loopback(ordinal, op_of(op), o, world, repeats, p, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("op"), py::arg("world"), py::arg("call"), py::arg("repeats") = 10,
      py::arg("path") = py::none());
  m.def("workspace_peer_base", [](int ordinal, int64_t global_id) {
    Workspace* ws = Runtime::instance().workspace(ordinal);
    if (ws == nullptr || !ws->peer_bases.count(global_id))
      throw std::runtime_error("jax_overlap: device " + std::to_string(global_id) + " is not mapped on GPU " +
                               std::to_string(ordinal));
    return reinterpret_cast<uintptr_t>(ws->peer_bases.at(global_id));
  });

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
  });
  // Calls that allocate, synchronize or map memory release the GIL while they wait on the GPU.
  m.def("init_device", [](int ordinal, int64_t global_id) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().init_device(ordinal, global_id));
  });
  m.def("allocate_workspace", [](int ordinal, uint64_t bytes) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().allocate_workspace(ordinal, bytes));
  });
  m.def("set_options", [](int ordinal, double watchdog_seconds, bool sync_after_launch, bool trace) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().set_options(ordinal, watchdog_seconds, sync_after_launch, trace));
  });
  m.def("synchronize", [](int ordinal) {
    py::gil_scoped_release release;
    int previous = 0;
    throw_if_error(Status{hipGetDevice(&previous) == hipSuccess ? "" : "jax_overlap: no current device"});
    const hipError_t set = hipSetDevice(ordinal);
    const hipError_t synced = set == hipSuccess ? hipDeviceSynchronize() : set;
    (void)hipSetDevice(previous);
    if (synced != hipSuccess) throw std::runtime_error(std::string("jax_overlap: ") + hipGetErrorString(synced));
  });
  m.def("set_abort_on_timeout", [](bool abort) { Runtime::instance().set_abort_on_timeout(abort); });
  m.def("generation", [] { return Runtime::instance().generation(); });
  // Fault injection for the tests of failure paths (runtime/faults.h): "name[=value],...", "" for none.
  m.def("set_faults", [](const std::string& spec) { faults::set_spec(spec); });
  m.def("faults", [] { return faults::spec(); });
  // Test hook: region epoch counters start from `origin` (new regions, and all after clear_errors()).
  m.def("set_epoch_origin", [](uint64_t origin) { Runtime::instance().set_epoch_origin(origin); });
  // The flag protocol's value rules, as kernels apply them, for the CPU tests (tests/test_protocol.py).
  m.def("flag_value", &flag_value, py::arg("epoch"), py::arg("site"));
  m.def(
      "flag_match",
      [](uint32_t value, uint32_t expected) {
        static const char* const kNames[] = {"no", "yes", "other site"};
        return std::string(kNames[static_cast<int>(match(value, expected))]);
      },
      py::arg("value"), py::arg("expected"));
  m.def(
      "pipelined_flag_state",
      [](uint32_t epoch, uint32_t site, uint32_t want_epoch, uint32_t want_site) {
        static const char* const kNames[] = {"pending", "released", "other site", "abandoned"};
        return std::string(kNames[static_cast<int>(pipe_state(epoch, site, want_epoch, want_site))]);
      },
      py::arg("epoch"), py::arg("site"), py::arg("want_epoch"), py::arg("want_site"));
  m.def(
      "epoch_slot_used",
      [](uint64_t origin, uint64_t epoch) {
        EpochCounter c;
        c.restart(origin);
        return c.slot_used(epoch);
      },
      py::arg("origin"), py::arg("epoch"));
  m.def("export_handle", [](int ordinal) {
    std::string h;
    {
      py::gil_scoped_release release;
      throw_if_error(Runtime::instance().export_handle(ordinal, &h));
    }
    return py::bytes(h);
  });
  m.def("import_peer", [](int ordinal, int64_t peer_id, py::bytes handle) {
    const std::string h(handle);
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().import_peer(ordinal, peer_id, h));
  });
  m.def("map_local_peer", [](int ordinal, int peer_ordinal) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().map_local_peer(ordinal, peer_ordinal));
  });
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
  });
  m.def("copy_path", [](int ordinal) -> py::object {
    const Workspace* ws = Runtime::instance().workspace(ordinal);
    pipelined::CopyPath path{};
    if (ws == nullptr || !Runtime::verified_copy_path(*ws, &path).ok()) return py::none();
    return py::str(pipelined::copy_path_name(path));
  });
  m.def("set_ranks_per_gpu", [](int ordinal, int ranks) {
    throw_if_error(Runtime::instance().set_ranks_per_gpu(ordinal, ranks));
  });
  m.def("error_record", &error_record);
  m.def("stop_after_error", [](int ordinal) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().stop_after_error(ordinal));
  });
  m.def("restart_after_error", [](int ordinal) {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().restart_after_error(ordinal));
  });
  m.def("read_trace", [](int ordinal) {
    std::string events;
    double ticks_per_us = 0;
    {
      py::gil_scoped_release release;
      throw_if_error(Runtime::instance().read_trace(ordinal, &events, &ticks_per_us));
    }
    return py::make_tuple(py::bytes(events), ticks_per_us);
  });
  m.def("release", [] {
    py::gil_scoped_release release;
    throw_if_error(Runtime::instance().release());
  });

  py::class_<SimGroup>(m, "SimGroup")
      .def(py::init([](int ordinal, int world, uint64_t bytes_per_rank, double watchdog_seconds) {
             std::unique_ptr<SimGroup> g;
             throw_if_error(SimGroup::create(ordinal, world, bytes_per_rank, watchdog_seconds, &g));
             return g;
           }),
           py::arg("ordinal"), py::arg("world"), py::arg("bytes_per_rank"), py::arg("watchdog_seconds") = 5.0)
      .def_property_readonly("world", &SimGroup::world)
      .def("ag_matmul",
           [](SimGroup& g, py::dict call) {
             SimMatmul c = sim_call(call);
             py::gil_scoped_release release;
             throw_if_error(g.ag_matmul(c));
           })
      .def("matmul_rs",
           [](SimGroup& g, py::dict call) {
             SimMatmul c = sim_call(call);
             py::gil_scoped_release release;
             throw_if_error(g.matmul_rs(c));
           })
      .def("all_gather",
           [](SimGroup& g, std::vector<uintptr_t> x, std::vector<uintptr_t> gathered, int64_t batch, int64_t m,
              int64_t row_bytes) {
             py::gil_scoped_release release;
             throw_if_error(g.all_gather(x, gathered, batch, m, row_bytes));
           })
      .def("pipelined_ag_matmul",
           [](SimGroup& g, py::dict call) {
             SimMatmul c = sim_call(call);
             py::gil_scoped_release release;
             throw_if_error(g.pipelined(OpKind::kAgMatmul, c));
           })
      .def("pipelined_matmul_rs",
           [](SimGroup& g, py::dict call) {
             SimMatmul c = sim_call(call);
             py::gil_scoped_release release;
             throw_if_error(g.pipelined(OpKind::kMatmulRs, c));
           })
      .def("synchronize",
           [](SimGroup& g) {
             py::gil_scoped_release release;
             throw_if_error(g.synchronize());
           })
      .def("errors", &SimGroup::errors)
      .def("clear_errors",
           [](SimGroup& g) {
             py::gil_scoped_release release;
             throw_if_error(g.clear_errors());
           })
      .def("set_absent", &SimGroup::set_absent, py::arg("rank"))
      .def("set_epoch_origin", &SimGroup::set_epoch_origin, py::arg("origin"));
}
