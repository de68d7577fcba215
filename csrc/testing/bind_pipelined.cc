// Bindings of the pipelined algorithm for the tests and benchmarks: its copies (paths, pieces, one copy waited
// for), and its schedule in loopback on one GPU: timed, its host enqueue timed, its cross-stream edges counted
// (pipelined/measure.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "blas/gemm.h"
#include "pipelined/copy.h"
#include "pipelined/measure.h"
#include "pipelined/schedule.h"
#include "pipelined/streams.h"
#include "testing/bindings.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace jo::bindings {
namespace {

// A loopback call of the op from a call dict: call_shape's keys, and the device pointers "x", "w", "bias" (0 for
// none), "out", "scratch", optionally "x_scale", "w_scale", "gathered", "gathered_scales" (0 or absent: none).
// whole: the call enqueues its whole schedule (timings, edges), so ag_matmul's needs its gathered x (and float8
// scales). Not copyable: operands points into stages.
struct LoopbackArgs {
  LoopbackArgs(int ordinal, const std::string& op_name, const py::dict& c, const std::optional<std::string>& path_name,
               bool whole)
      : op(gemm_op_arg(op_name)), path(copy_path_of(ordinal, path_name)) {
    const auto pointer = [&](const char* key) { return c.contains(key) ? c[key].cast<uintptr_t>() : uintptr_t{0}; };
    operands = call_shape(c, pointer("bias") != 0, &stages);
    operands.x = reinterpret_cast<const void*>(c["x"].cast<uintptr_t>());
    operands.w = reinterpret_cast<const void*>(c["w"].cast<uintptr_t>());
    operands.bias = reinterpret_cast<const void*>(pointer("bias"));
    operands.x_scale = reinterpret_cast<const float*>(pointer("x_scale"));
    operands.w_scale = reinterpret_cast<const float*>(pointer("w_scale"));
    operands.out = reinterpret_cast<void*>(c["out"].cast<uintptr_t>());
    operands.gathered = reinterpret_cast<void*>(pointer("gathered"));
    operands.gathered_scales = reinterpret_cast<float*>(pointer("gathered_scales"));
    operands.scratch = reinterpret_cast<void*>(c["scratch"].cast<uintptr_t>());
    if (operands.gemm.types.scaled && (operands.x_scale == nullptr || operands.w_scale == nullptr))
      throw std::invalid_argument("jax_overlap: a float8 loopback call takes x_scale and w_scale (and ag_matmul "
                                  "gathered_scales)");
    if (whole && op == OpKind::kAgMatmul &&
        (operands.gathered == nullptr || (operands.gemm.types.scaled && operands.gathered_scales == nullptr)))
      throw std::invalid_argument("jax_overlap: a loopback ag_matmul takes gathered (and, float8, gathered_scales)");
  }
  LoopbackArgs(const LoopbackArgs&) = delete;
  LoopbackArgs& operator=(const LoopbackArgs&) = delete;

  std::vector<int64_t> stages;
  pipelined::Operands operands{};
  OpKind op;
  pipelined::CopyPath path;
};

}  // namespace

void bind_pipelined_harness(py::module_& m) {
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
  // One 2-D copy on `path` on a stream of its own, waited for (max_bytes 0: the cap in force).
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

  // The GEMM problems of one loopback call (LoopbackArgs), with its own pointers.
  m.def(
      "loopback_gemm_problems",
      [](int ordinal, const std::string& op, int world, py::dict call) {
        const LoopbackArgs a(ordinal, op, call, std::nullopt, /*whole=*/false);
        int sm_count = 0;
        if (hipDeviceGetAttribute(&sm_count, hipDeviceAttributeMultiprocessorCount, ordinal) != hipSuccess)
          throw std::runtime_error("jax_overlap: cannot read GPU " + std::to_string(ordinal) + "'s SM count");
        std::vector<GemmProblem> problems;
        throw_if_error(pipelined::loopback_problems(a.op, a.operands, world, sm_count, &problems));
        return problem_ids(problems);
      },
      py::arg("ordinal"), py::arg("op"), py::arg("world"), py::arg("call"));
  // path None: the verified path (copy_path_of).
  m.def(
      "time_loopback",
      [](int ordinal, const std::string& op, int world, py::dict call, int repeats, std::optional<std::string> path,
         bool back_to_back) {
        const LoopbackArgs a(ordinal, op, call, path, /*whole=*/true);
        double us = 0;
        py::gil_scoped_release release;
        throw_if_error(pipelined::time_loopback(ordinal, a.op, a.operands, world, repeats, a.path, back_to_back, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("op"), py::arg("world"), py::arg("call"), py::arg("repeats") = 10,
      py::arg("path") = py::none(), py::arg("back_to_back") = false);
  m.def(
      "time_loopback_enqueue",
      [](int ordinal, const std::string& op, int world, py::dict call, int repeats, std::optional<std::string> path) {
        const LoopbackArgs a(ordinal, op, call, path, /*whole=*/true);
        double us = 0;
        py::gil_scoped_release release;
        throw_if_error(pipelined::time_loopback_enqueue(ordinal, a.op, a.operands, world, repeats, a.path, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("op"), py::arg("world"), py::arg("call"), py::arg("repeats") = 10,
      py::arg("path") = py::none());
  // {"records": n, "waits": n} (pipelined/streams.h).
  m.def(
      "loopback_edges",
      [](int ordinal, const std::string& op, int world, py::dict call, std::optional<std::string> path) {
        const LoopbackArgs a(ordinal, op, call, path, /*whole=*/true);
        pipelined::StreamEdges edges;
        {
          py::gil_scoped_release release;
          throw_if_error(pipelined::loopback_edges(ordinal, a.op, a.operands, world, a.path, &edges));
        }
        return py::dict("records"_a = edges.records, "waits"_a = edges.waits);
      },
      py::arg("ordinal"), py::arg("op"), py::arg("world"), py::arg("call"), py::arg("path") = py::none());
}

}  // namespace jo::bindings
