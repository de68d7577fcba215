// Bindings of the vendor GEMM's tooling for the tests and benchmarks: problem ids in words and fields, the plan a
// problem runs, candidates timed, the tuning cache's file format, and the counters of plans and runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "blas/gemm.h"
#include "blas/tuning.h"
#include "ffi/handlers.h"
#include "testing/bindings.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace jo::bindings {

py::dict gemm_problem_dict(const GemmProblem& p) {
  return py::dict("x"_a = dtype_name(p.types.x), "w"_a = dtype_name(p.types.w), "out"_a = dtype_name(p.types.out),
                  "bias_type"_a = dtype_name(p.types.bias), "scaled"_a = p.types.scaled, "blocks"_a = p.types.blocks,
                  "fast_accumulation"_a = p.types.fast_accumulation, "rows"_a = p.rows, "n"_a = p.n, "k"_a = p.k,
                  "batch"_a = p.batch, "ldx"_a = p.ldx, "ldy"_a = p.ldy, "ldw"_a = p.ldw,
                  "x_stride"_a = p.x_batch_stride, "y_stride"_a = p.y_batch_stride, "w_kmajor"_a = p.w_kmajor,
                  "bias"_a = p.bias, "alignment"_a = p.alignment, "sm_count"_a = p.sm_count,
                  "id"_a = blas::problem_id(p));
}

void bind_blas(py::module_& m) {
  // The float8 formats the vendor GEMM runs on a GPU of architecture `arch` ("sm_90", "gfx942": the
  // runtime's device_info), by jax's names.
  m.def(
      "vendor_fp8_dtypes",
      [](const std::string& arch) {
        py::list names;
        for (DType t : kDTypes)
          if (is_fp8(t) && blas::takes_fp8(t, arch)) names.append(dtype_name(t));
        return names;
      },
      py::arg("arch"));
  m.def("vendor_gemm_runs", [] {
    const VendorGemmRuns r = vendor_gemm_runs();
    return py::dict("runs"_a = r.runs, "captured"_a = r.captured, "handler_ns"_a = r.handler_ns,
                    "vendor_ns"_a = r.vendor_ns);
  });
  m.def("count_vendor_gemm_runs", &count_vendor_gemm_runs, py::arg("on"));
  m.def("blas_counters", [] {
    const blas::BlasCounters c = blas::blas_counters();
    return py::dict("plans_made"_a = c.plans_made, "plan_lookups"_a = c.plan_lookups,
                    "descriptor_writes"_a = c.descriptor_writes, "tuned"_a = c.tuned,
                    "installs_refused"_a = c.installs_refused, "shared_handles"_a = c.shared_handles);
  });
  m.def("describe_gemm_problem", [](const std::string& id) { return blas::describe(problem_arg(id)); },
        py::arg("id"));
  m.def("gemm_problem_fields", [](const std::string& id) { return gemm_problem_dict(problem_arg(id)); },
        py::arg("id"));
  // The heuristic's first `candidates` for a problem on GPU `ordinal`, each timed as tune_gemm times them but
  // under the protocol given (samples of sample_us, `rounds` turns, after warmup_us of the first); no plan changes.
  m.def(
      "gemm_candidate_times",
      [](int ordinal, const std::string& id, int candidates, double sample_us, int rounds, double warmup_us) {
        const GemmProblem p = problem_arg(id);
        std::vector<blas::CandidateTime> times;
        {
          py::gil_scoped_release release;
          blas::DeviceBlas* blas = nullptr;
          throw_if_error(blas::DeviceBlas::prepare(ordinal, &blas));
          throw_if_error(blas->candidate_times(p, candidates, blas::TimingProtocol{sample_us, rounds, warmup_us},
                                               &times));
        }
        py::list out;
        for (const blas::CandidateTime& c : times)
          out.append(py::dict("index"_a = c.index, "us"_a = c.us, "status"_a = c.status,
                              "workspace_bytes"_a = c.workspace_bytes, "waves"_a = c.waves));
        return out;
      },
      py::arg("ordinal"), py::arg("id"), py::arg("candidates"), py::arg("sample_us"), py::arg("rounds") = 3,
      py::arg("warmup_us") = 0.0);
  // The plan a call of the problem runs on GPU `ordinal` (made with the heuristic's first if none was).
  m.def(
      "gemm_plan",
      [](int ordinal, const std::string& id) {
        const GemmProblem p = problem_arg(id);
        const blas::GemmPlan* plan = nullptr;
        {
          py::gil_scoped_release release;
          blas::DeviceBlas* blas = nullptr;
          throw_if_error(blas::DeviceBlas::prepare(ordinal, &blas));
          throw_if_error(blas->plan(p, &plan));
        }
        return py::dict("source"_a = blas::algo_source_name(plan->source()), "index"_a = plan->index(),
                        "choice"_a = blas::to_hex(&plan->algo(), sizeof(blas::Algo)));
      },
      py::arg("ordinal"), py::arg("id"));
  // The tuning cache's file format (blas/tuning.h): entries as {id: (algo, index, us, first_us)}; reading returns
  // (entries, why they were ignored: "" when they were not).
  m.def(
      "read_gemm_cache",
      [](const std::string& path, const std::string& header) {
        std::string ignored;
        py::dict out;
        for (const auto& [id, e] : blas::read_cache(path, header, &ignored))
          out[py::str(id)] = py::make_tuple(e.algo, e.index, e.us, e.first_us);
        return py::make_tuple(out, ignored);
      },
      py::arg("path"), py::arg("header"));
  m.def(
      "write_gemm_cache",
      [](const std::string& path, const std::string& header, py::dict entries) {
        blas::CacheEntries written;
        for (auto item : entries) {
          const auto t = item.second.cast<py::tuple>();
          written[item.first.cast<std::string>()] = blas::CacheEntry{t[0].cast<std::string>(), t[1].cast<int>(),
                                                                     t[2].cast<double>(), t[3].cast<double>()};
        }
        throw_if_error(blas::write_cache(path, header, written));
      },
      py::arg("path"), py::arg("header"), py::arg("entries"));
  m.def("gemm_cache_path", &blas::cache_path, py::arg("dir"), py::arg("header"));
  m.attr("GEMM_ALGO_HEX_DIGITS") = 2 * sizeof(blas::Algo);
}

}  // namespace jo::bindings
