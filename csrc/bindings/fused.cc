// Bindings of the fused kernels for jax_overlap/planning/fused.py: the compiled tiles
// and the launch C++ makes of a call (kernels/launch.h gemm_geometry), and
// the kernels' scratch and region sizes.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "bindings/bindings.h"
#include "kernels/ag_matmul.h"
#include "kernels/all_gather.h"
#include "kernels/matmul_rs.h"
#include "kernels/tile_registry.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace jo::bindings {
namespace {

py::dict tile_shape_dict(int index) {
  TileShapeInfo info{};
  if (!tile_shape_info(index, &info)) throw std::out_of_range("no tile shape " + std::to_string(index));
  return py::dict("index"_a = index, "bm"_a = info.bm, "bn"_a = info.bn, "bk"_a = info.bk,
                  "threads"_a = info.threads, "smem_bytes"_a = info.smem_bytes, "stream_k"_a = info.stream_k,
                  "arch"_a = info.arch);
}

// The launch of one fused GEMM call (kernels/launch.h gemm_geometry). m:
// ag_matmul's local rows, matmul_rs's total rows (per batch element).
// workgroups_per_sm == 0: the kernel's occupancy on the current device.
py::dict gemm_geometry(const std::string& op, int tile, const std::string& dtype, bool w_kmajor, int world,
                       int64_t batch, int64_t m, int64_t k, int64_t n, int chunk_k, int comm_workgroups, int sm_count,
                       int ranks_per_gpu, int64_t l2_bytes, int workgroups_per_sm) {
  const OpKind kind = gemm_op_arg(op);
  GemmOperands operands{};
  operands.dtype = dtype_arg(dtype, "the fused kernels take");
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
  switch (kind) {
    case OpKind::kAgMatmul: {
      AgMatmulLaunch l{};
      l.op = operands;
      l.m = m;
      l.chunk_k = chunk_k;
      l.ctx = ctx;
      e = ag_matmul_geometry(l, workgroups_per_sm, &g);
      break;
    }
    case OpKind::kMatmulRs: {
      MatmulRsLaunch l{};
      l.op = operands;
      l.m_total = m;
      l.ctx = ctx;
      e = matmul_rs_geometry(l, workgroups_per_sm, &g);
      break;
    }
    case OpKind::kAllGather: break;  // no GEMM
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

}  // namespace

void bind_fused(py::module_& m) {
  m.def("tile_shapes", [] {
    py::list out;
    for (int i = 0; i < tile_shape_count(); ++i) out.append(tile_shape_dict(i));
    return out;
  });
  m.def("gemm_geometry", &gemm_geometry, py::arg("op"), py::arg("tile"), py::arg("dtype"), py::arg("w_kmajor"),
        py::arg("world"), py::arg("batch"), py::arg("m"), py::arg("k"), py::arg("n"), py::arg("chunk_k"),
        py::arg("comm_workgroups"), py::arg("sm_count"), py::arg("ranks_per_gpu"), py::arg("l2_bytes"),
        py::arg("workgroups_per_sm") = 0);
  m.def("all_gather_region_bytes", &all_gather_region_bytes, py::arg("world"), py::arg("rows"),
        py::arg("row_bytes"));
}

}  // namespace jo::bindings
