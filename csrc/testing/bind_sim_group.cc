// Bindings of the simulated ranks (testing/sim_group.h) that the GPU tests and
// benchmarks drive.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "testing/bindings.h"
#include "testing/sim_group.h"

namespace py = pybind11;

namespace jo::bindings {
namespace {

SimMatmul sim_call(py::dict c) {
  SimMatmul s{};
  s.types = gemm_types_arg(c, "SimGroup takes");
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
  if (c.contains("x_scale")) s.x_scale = c["x_scale"].cast<std::vector<uintptr_t>>();
  if (c.contains("w_scale")) s.w_scale = c["w_scale"].cast<std::vector<uintptr_t>>();
  if (c.contains("gathered_scales")) s.gathered_scales = c["gathered_scales"].cast<std::vector<uintptr_t>>();
  if (c.contains("stages")) s.stages = c["stages"].cast<std::vector<int64_t>>();
  if (c.contains("site")) s.site = c["site"].cast<uint32_t>();
  if (c.contains("ranks")) s.ranks = c["ranks"].cast<std::vector<int>>();
  if (c.contains("sync")) s.sync = c["sync"].cast<bool>();
  return s;
}

}  // namespace

void bind_sim_group(py::module_& m) {
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

}  // namespace jo::bindings
