// Bindings of the pipelined algorithm: its scratch and region sizes, the
// vendor GEMM's set-up and tuning, and the timings the cost model is fed with
// (pipelined/measure.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "blas/capture_check.h"
#include "blas/gemm.h"
#include "blas/tuning.h"
#include "pipelined/copy.h"
#include "pipelined/measure.h"
#include "pipelined/schedule.h"
#include "pipelined/streams.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace jo::bindings {
namespace {

py::dict tune_dict(const blas::TuneResult& r) {
  return py::dict("choice"_a = r.choice, "source"_a = blas::algo_source_name(r.source), "index"_a = r.index,
                  "candidates"_a = r.candidates, "timed"_a = r.timed, "dropped"_a = r.dropped, "us"_a = r.us,
                  "first_us"_a = r.first_us, "detail"_a = r.detail);
}

}  // namespace

void bind_pipelined(py::module_& m) {
  // x_bytes: x's element; out_bytes: y's (matmul_rs's partials'); scaled: float8 operands; blocks: with block
  // scales (ag_matmul's shard carries them in its slot header).
  m.def(
      "pipelined_region_bytes",
      [](const std::string& op, int world, int64_t batch, int64_t m, int64_t k, int64_t n, int x_bytes,
         int out_bytes, bool scaled, bool blocks) {
        return pipelined::region_bytes(gemm_op_arg(op), world, batch, m, k, n, x_bytes, out_bytes, scaled, blocks);
      },
      py::arg("op"), py::arg("world"), py::arg("batch"), py::arg("m"), py::arg("k"), py::arg("n"),
      py::arg("x_bytes"), py::arg("out_bytes"), py::arg("scaled") = false, py::arg("blocks") = false);
  m.def(
      "pipelined_scratch_bytes",
      [](const std::string& op, int world, int64_t batch, int64_t m, int64_t n, int out_bytes, bool loopback) {
        return pipelined::scratch_bytes(gemm_op_arg(op), world, batch, m, n, out_bytes, loopback);
      },
      py::arg("op"), py::arg("world"), py::arg("batch"), py::arg("m"), py::arg("n"), py::arg("out_bytes"),
      py::arg("loopback") = false);
  // Loads the vendor BLAS on GPU `ordinal`, makes its handles (the side streams' too) and runs its capture check
  // (blas/capture_check.h) once.
  m.def("prepare_vendor_blas", [](int ordinal) {
    blas::CaptureCheck check;
    {
      py::gil_scoped_release release;
      blas::DeviceBlas* blas = nullptr;
      throw_if_error(blas::DeviceBlas::prepare(ordinal, &blas));
      throw_if_error(pipelined::attach_side_stream_blas(ordinal));
      throw_if_error(blas::check_graph_capture(ordinal, &check));
    }
    return py::dict("graph_safe"_a = check.graph_safe, "detail"_a = check.detail,
                    "checked_now"_a = check.checked_now);
  }, py::arg("ordinal"));
  m.def("vendor_gemm_graph_safe", &blas::graph_capture_safe);
  // The GEMM problems (blas/gemm.h problem_id) a call of the op runs on any rank of `world` (pipelined::gemm_problems:
  // host work only). call: "dtype" (and "w_dtype", "out_dtype", "blocks", "fast_accumulation": gemm_types_arg),
  // "batch", "m", "k", "n", "w_kmajor", "bias" (bool), "stages", optionally "x_scale_shared".
  m.def(
      "gemm_problems",
      [](const std::string& op, int world, py::dict c, int sm_count) {
        std::vector<int64_t> stages;
        const pipelined::Operands shape = call_shape(c, c["bias"].cast<bool>(), &stages);
        std::vector<GemmProblem> problems;
        throw_if_error(pipelined::gemm_problems(gemm_op_arg(op), shape, world, sm_count, &problems));
        return problem_ids(problems);
      },
      py::arg("op"), py::arg("world"), py::arg("call"), py::arg("sm_count"));
  // Chooses the algorithm of a problem on GPU `ordinal` (blas::DeviceBlas::tune): candidates 1 takes the
  // heuristic's first; cache_dir "" reads and writes no tuning cache.
  m.def(
      "tune_gemm",
      [](int ordinal, const std::string& id, int candidates, double margin, const std::string& cache_dir) {
        const GemmProblem p = problem_arg(id);
        blas::TuneResult r;
        {
          py::gil_scoped_release release;
          blas::DeviceBlas* blas = nullptr;
          throw_if_error(blas::DeviceBlas::prepare(ordinal, &blas));
          throw_if_error(blas->tune(p, blas::TuningOptions{candidates, margin, cache_dir}, &r));
        }
        return tune_dict(r);
      },
      py::arg("ordinal"), py::arg("id"), py::arg("candidates"), py::arg("margin"), py::arg("cache_dir") = "");
  // Makes another GPU's or process's choice (tune_gemm's "choice") this GPU's, where its heuristic lists it.
  m.def(
      "install_gemm_algo",
      [](int ordinal, const std::string& id, const std::string& choice, int candidates) {
        const GemmProblem p = problem_arg(id);
        bool accepted = false;
        py::gil_scoped_release release;
        blas::DeviceBlas* blas = nullptr;
        throw_if_error(blas::DeviceBlas::prepare(ordinal, &blas));
        throw_if_error(blas->install(p, choice, candidates, &accepted));
        return accepted;
      },
      py::arg("ordinal"), py::arg("id"), py::arg("choice"), py::arg("candidates"));
  // dtype: x's; w_dtype: x's when None; out_dtype: x's when None, required with float8 x.
  m.def(
      "time_gemms",
      [](int ordinal, const std::string& dtype, std::vector<int64_t> rows, int64_t n, int64_t k, bool w_kmajor,
         int repeats, double warmup_ms, std::optional<std::string> w_dtype, std::optional<std::string> out_dtype,
         bool blocks, bool fast_accumulation, int candidates, double margin, const std::string& cache_dir) {
        py::dict names("dtype"_a = dtype, "blocks"_a = blocks, "fast_accumulation"_a = fast_accumulation);
        if (w_dtype) names["w_dtype"] = *w_dtype;
        if (out_dtype) names["out_dtype"] = *out_dtype;
        const GemmTypes types = gemm_types_arg(names, kPipelinedTakes);
        std::vector<double> us;
        py::gil_scoped_release release;
        throw_if_error(pipelined::time_gemms(ordinal, types, rows, n, k, w_kmajor, repeats, warmup_ms,
                                             blas::TuningOptions{candidates, margin, cache_dir}, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("dtype"), py::arg("rows"), py::arg("n"), py::arg("k"), py::arg("w_kmajor") = false,
      py::arg("repeats") = 5, py::arg("warmup_ms") = 0.0, py::arg("w_dtype") = py::none(),
      py::arg("out_dtype") = py::none(), py::arg("blocks") = false, py::arg("fast_accumulation") = false,
      py::arg("candidates") = 1, py::arg("margin") = 0.02, py::arg("cache_dir") = "");
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
  m.def(
      "time_reduce",
      [](int ordinal, const std::string& dtype, int count, int64_t rows, int64_t n, int repeats) {
        const DType t = dtype_arg(dtype, kPipelinedTakes);
        double us = 0;
        py::gil_scoped_release release;
        throw_if_error(pipelined::time_reduce(ordinal, t, count, rows, n, repeats, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("dtype"), py::arg("count"), py::arg("rows"), py::arg("n"), py::arg("repeats") = 5);
}

}  // namespace jo::bindings
