// Bindings of the pipelined algorithm: its scratch and region sizes, copy
// paths, the vendor GEMM's set-up, and the timings the cost model is fed with
// (pipelined/measure.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "blas/capture_check.h"
#include "blas/gemm.h"
#include "blas/tuning.h"
#include "ffi/handlers.h"
#include "pipelined/copy.h"
#include "pipelined/measure.h"
#include "pipelined/schedule.h"
#include "pipelined/streams.h"
#include "runtime/runtime.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace jo::bindings {
namespace {

constexpr const char* kTakes = "the pipelined algorithm takes";

// The schedule's options a call dict may name: "x_scale_shared" (default false).
void read_schedule_options(py::dict c, pipelined::Operands* o) {
  o->x_scale_shared = c.contains("x_scale_shared") && c["x_scale_shared"].cast<bool>();
}

// A loopback call of the op (pipelined/schedule.h) from a dict of device pointers and sizes (and dtypes:
// gemm_types_arg; the scales' layouts with "blocks": pipelined::Operands).
pipelined::Operands loopback_operands(py::dict c, std::vector<int64_t>* stages) {
  pipelined::Operands o{};
  o.x = reinterpret_cast<const void*>(c["x"].cast<uintptr_t>());
  o.w = reinterpret_cast<const void*>(c["w"].cast<uintptr_t>());
  o.bias = reinterpret_cast<const void*>(c["bias"].cast<uintptr_t>());
  const auto pointer = [&](const char* key) { return c.contains(key) ? c[key].cast<uintptr_t>() : uintptr_t{0}; };
  o.x_scale = reinterpret_cast<const float*>(pointer("x_scale"));
  o.w_scale = reinterpret_cast<const float*>(pointer("w_scale"));
  o.out = reinterpret_cast<void*>(c["out"].cast<uintptr_t>());
  o.gathered = reinterpret_cast<void*>(pointer("gathered"));
  o.gathered_scales = reinterpret_cast<float*>(pointer("gathered_scales"));
  o.scratch = reinterpret_cast<void*>(c["scratch"].cast<uintptr_t>());
  o.gemm = GemmProblem::dense(gemm_types_arg(c, kTakes), c["batch"].cast<int64_t>(), c["m"].cast<int64_t>(),
                              c["k"].cast<int64_t>(), c["n"].cast<int64_t>(), c["w_kmajor"].cast<bool>(),
                              o.bias != nullptr);
  if (o.gemm.types.scaled && (o.x_scale == nullptr || o.w_scale == nullptr))
    throw std::invalid_argument("jax_overlap: a float8 loopback call takes x_scale and w_scale (and ag_matmul "
                                "gathered_scales)");
  read_schedule_options(c, &o);
  *stages = c["stages"].cast<std::vector<int64_t>>();
  o.stages = stages->data();
  o.stage_count = static_cast<int>(stages->size());
  return o;
}

// A timed loopback call enqueues the whole schedule: ag_matmul's needs its gathered x (and float8 scales).
void check_timed_loopback(OpKind kind, const pipelined::Operands& o) {
  if (kind == OpKind::kAgMatmul && (o.gathered == nullptr || (o.gemm.types.scaled && !o.gathered_scales)))
    throw std::invalid_argument("jax_overlap: a loopback ag_matmul takes gathered (and, float8, gathered_scales)");
}

// The copy path a timing or test names ("copy_engine", ...); none: the path initialize() verified on the
// GPU, or before it did, the first candidate (planning/figures.py's guess of the link precedes initialize()).
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

// The problem a problem id names; ValueError for text that is not one.
GemmProblem problem_arg(const std::string& id) {
  GemmProblem p{};
  if (!blas::parse_problem_id(id, &p))
    throw std::invalid_argument("jax_overlap: not a GEMM problem id (blas/gemm.h problem_id): " + id);
  return p;
}

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
  });
  m.def("vendor_gemm_graph_safe", &blas::graph_capture_safe);
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
  // The GEMM problems (blas/gemm.h problem_id) a call of the op runs on any rank of `world` (pipelined::gemm_problems:
  // host work only). call: "dtype" (and "w_dtype", "out_dtype", "blocks", "fast_accumulation": gemm_types_arg),
  // "batch", "m", "k", "n", "w_kmajor", "bias" (bool), "stages", optionally "x_scale_shared".
  m.def(
      "gemm_problems",
      [](const std::string& op, int world, py::dict c, int sm_count) {
        pipelined::Operands shape{};
        shape.gemm = GemmProblem::dense(gemm_types_arg(c, kTakes), c["batch"].cast<int64_t>(), c["m"].cast<int64_t>(),
                                        c["k"].cast<int64_t>(), c["n"].cast<int64_t>(), c["w_kmajor"].cast<bool>(),
                                        c["bias"].cast<bool>());
        const std::vector<int64_t> stages = c["stages"].cast<std::vector<int64_t>>();
        shape.stages = stages.data();
        shape.stage_count = static_cast<int>(stages.size());
        read_schedule_options(c, &shape);
        std::vector<GemmProblem> problems;
        throw_if_error(pipelined::gemm_problems(gemm_op_arg(op), shape, world, sm_count, &problems));
        std::vector<std::string> ids;
        for (const GemmProblem& p : problems) ids.push_back(blas::problem_id(p));
        return ids;
      },
      py::arg("op"), py::arg("world"), py::arg("call"), py::arg("sm_count"));
  // The GEMM problems of one loopback call (a time_loopback call dict), with its own pointers.
  m.def(
      "loopback_gemm_problems",
      [](int ordinal, const std::string& op, int world, py::dict call) {
        std::vector<int64_t> stages;
        const pipelined::Operands o = loopback_operands(call, &stages);
        int sm_count = 0;
        if (hipDeviceGetAttribute(&sm_count, hipDeviceAttributeMultiprocessorCount, ordinal) != hipSuccess)
          throw std::runtime_error("jax_overlap: cannot read GPU " + std::to_string(ordinal) + "'s SM count");
        std::vector<GemmProblem> problems;
        throw_if_error(pipelined::loopback_problems(gemm_op_arg(op), o, world, sm_count, &problems));
        std::vector<std::string> ids;
        for (const GemmProblem& p : problems) ids.push_back(blas::problem_id(p));
        return ids;
      },
      py::arg("ordinal"), py::arg("op"), py::arg("world"), py::arg("call"));
  // A problem id's fields (ValueError for text that is not one), and in words.
  m.def("describe_gemm_problem", [](const std::string& id) { return blas::describe(problem_arg(id)); });
  m.def("gemm_problem_fields", [](const std::string& id) {
    const GemmProblem p = problem_arg(id);
    return py::dict("x"_a = dtype_name(p.types.x), "w"_a = dtype_name(p.types.w), "out"_a = dtype_name(p.types.out),
                    "bias_type"_a = dtype_name(p.types.bias), "scaled"_a = p.types.scaled,
                    "blocks"_a = p.types.blocks, "fast_accumulation"_a = p.types.fast_accumulation,
                    "rows"_a = p.rows, "n"_a = p.n, "k"_a = p.k, "batch"_a = p.batch,
                    "ldx"_a = p.ldx, "ldy"_a = p.ldy, "ldw"_a = p.ldw, "x_stride"_a = p.x_batch_stride,
                    "y_stride"_a = p.y_batch_stride, "w_kmajor"_a = p.w_kmajor, "bias"_a = p.bias,
                    "alignment"_a = p.alignment, "sm_count"_a = p.sm_count, "id"_a = blas::problem_id(p));
  });
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
  // The heuristic's first `candidates` for a problem on GPU `ordinal`, each timed as tune_gemm times them but
  // under the protocol given (samples of sample_us, `rounds` turns, after warmup_us of the first): a tool for the
  // benchmarks; no plan changes.
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
  // The plan a call of the problem runs on GPU `ordinal` (made with the heuristic's first if none was).
  m.def("gemm_plan", [](int ordinal, const std::string& id) {
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
  });
  // The tuning cache's file format (blas/tuning.h), for the CPU tests: entries as {id: (algo, index, us,
  // first_us)}; reading returns (entries, why they were ignored: "" when they were not).
  m.def("read_gemm_cache", [](const std::string& path, const std::string& header) {
    std::string ignored;
    py::dict out;
    for (const auto& [id, e] : blas::read_cache(path, header, &ignored))
      out[py::str(id)] = py::make_tuple(e.algo, e.index, e.us, e.first_us);
    return py::make_tuple(out, ignored);
  });
  m.def("write_gemm_cache", [](const std::string& path, const std::string& header, py::dict entries) {
    blas::CacheEntries written;
    for (auto item : entries) {
      const auto t = item.second.cast<py::tuple>();
      written[item.first.cast<std::string>()] = blas::CacheEntry{t[0].cast<std::string>(), t[1].cast<int>(),
                                                                 t[2].cast<double>(), t[3].cast<double>()};
    }
    throw_if_error(blas::write_cache(path, header, written));
  });
  m.def("gemm_cache_path", &blas::cache_path, py::arg("dir"), py::arg("header"));
  m.attr("GEMM_ALGO_HEX_DIGITS") = 2 * sizeof(blas::Algo);
  // dtype: x's; w_dtype: x's when None; out_dtype: x's when None, required with float8 x.
  m.def(
      "time_gemms",
      [](int ordinal, const std::string& dtype, std::vector<int64_t> rows, int64_t n, int64_t k, bool w_kmajor,
         int repeats, double warmup_ms, std::optional<std::string> w_dtype, std::optional<std::string> out_dtype,
         bool blocks, bool fast_accumulation, int candidates, double margin, const std::string& cache_dir) {
        py::dict names("dtype"_a = dtype, "blocks"_a = blocks, "fast_accumulation"_a = fast_accumulation);
        if (w_dtype) names["w_dtype"] = *w_dtype;
        if (out_dtype) names["out_dtype"] = *out_dtype;
        const GemmTypes types = gemm_types_arg(names, kTakes);
        std::vector<double> us;
        py::gil_scoped_release release;
        throw_if_error(pipelined::time_gemms(ordinal, types, rows, n, k, w_kmajor, repeats, warmup_ms,
                                             blas::TuningOptions{candidates, margin, cache_dir}, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("dtype"), py::arg("rows"), py::arg("n"), py::arg("k"), py::arg("w_kmajor") = false,
      py::arg("repeats") = 5, py::arg("warmup_ms") = 0.0, py::arg("w_dtype") = py::none(),
      py::arg("out_dtype") = py::none(), py::arg("blocks") = false, py::arg("fast_accumulation") = false,
      py::arg("candidates") = 1,
      py::arg("margin") = 0.02, py::arg("cache_dir") = "");
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
        const DType t = dtype_arg(dtype, kTakes);
        double us = 0;
        py::gil_scoped_release release;
        throw_if_error(pipelined::time_reduce(ordinal, t, count, rows, n, repeats, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("dtype"), py::arg("count"), py::arg("rows"), py::arg("n"), py::arg("repeats") = 5);
  m.def(
      "time_loopback",
      [](int ordinal, const std::string& op, int world, py::dict call, int repeats, std::optional<std::string> path,
         bool back_to_back) {
        std::vector<int64_t> stages;
        const pipelined::Operands o = loopback_operands(call, &stages);
        const pipelined::CopyPath p = copy_path_of(ordinal, path);
        const OpKind kind = gemm_op_arg(op);
        check_timed_loopback(kind, o);
        double us = 0;
        py::gil_scoped_release release;
        throw_if_error(pipelined::time_loopback(ordinal, kind, o, world, repeats, p, back_to_back, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("op"), py::arg("world"), py::arg("call"), py::arg("repeats") = 10,
      py::arg("path") = py::none(), py::arg("back_to_back") = false);
  // The host's time (us) to enqueue one loopback call, calls back to back (pipelined/measure.h).
  m.def(
      "time_loopback_enqueue",
      [](int ordinal, const std::string& op, int world, py::dict call, int repeats, std::optional<std::string> path) {
        std::vector<int64_t> stages;
        const pipelined::Operands o = loopback_operands(call, &stages);
        const pipelined::CopyPath p = copy_path_of(ordinal, path);
        const OpKind kind = gemm_op_arg(op);
        check_timed_loopback(kind, o);
        double us = 0;
        py::gil_scoped_release release;
        throw_if_error(pipelined::time_loopback_enqueue(ordinal, kind, o, world, repeats, p, &us));
        return us;
      },
      py::arg("ordinal"), py::arg("op"), py::arg("world"), py::arg("call"), py::arg("repeats") = 10,
      py::arg("path") = py::none());
  // The cross-stream edges one loopback call enqueues (pipelined/streams.h): {"records": n, "waits": n}.
  m.def(
      "loopback_edges",
      [](int ordinal, const std::string& op, int world, py::dict call, std::optional<std::string> path) {
        std::vector<int64_t> stages;
        const pipelined::Operands o = loopback_operands(call, &stages);
        const pipelined::CopyPath p = copy_path_of(ordinal, path);
        pipelined::StreamEdges edges;
        {
          py::gil_scoped_release release;
          throw_if_error(pipelined::loopback_edges(ordinal, gemm_op_arg(op), o, world, p, &edges));
        }
        return py::dict("records"_a = edges.records, "waits"_a = edges.waits);
      },
      py::arg("ordinal"), py::arg("op"), py::arg("world"), py::arg("call"), py::arg("path") = py::none());
}

}  // namespace jo::bindings
