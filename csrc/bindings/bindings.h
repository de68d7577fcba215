// The Python module jax_overlap._native, bound by concern: csrc/module.cc's
// PYBIND11_MODULE calls each bind_* below on the module, and each lives in
// the file of that name here. It holds what the package calls, nothing more
// (tests/test_native_surface.py); the tests' and benchmarks' functions are the
// harness module's (csrc/testing/bindings.h). The argument readers below serve both.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "blas/gemm.h"
#include "core/dtype.h"
#include "core/gemm_problem.h"
#include "core/op_kind.h"
#include "pipelined/copy.h"
#include "pipelined/schedule.h"
#include "platform/status.h"
#include "runtime/runtime.h"

namespace jo::bindings {

// The FFI targets and their registrations, the build (registrations.cc).
void bind_registrations(pybind11::module_& m);
// The runtime jax_overlap/runtime/workspace.py drives: devices, workspaces, peers, errors (runtime.cc).
void bind_runtime(pybind11::module_& m);
// The pipelined algorithm's sizes, vendor GEMM set-up and tuning, and the timings the cost model is fed with
// (pipelined.cc).
void bind_pipelined(pybind11::module_& m);
// The fused kernels' compiled tiles and launch geometry, for jax_overlap/planning/fused.py (fused.cc).
void bind_fused(pybind11::module_& m);

// A failed status as the Python exception (RuntimeError) of its message.
inline void throw_if_error(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message);
}

// The DType of a dtype name from Python; otherwise a ValueError naming the name, after `takes`
// ("the pipelined algorithm takes") and the dtypes.
inline DType dtype_arg(const std::string& name, const char* takes) {
  DType t{};
  if (!dtype_from_name(name, &t))
    throw std::invalid_argument(std::string("jax_overlap: ") + takes + " " + dtype_choices() + ", got " + name);
  return t;
}

// A GEMM's types from a call dict of the tests and benchmarks: "dtype" (x's), and optionally "w_dtype" (x's
// by default), "out_dtype" (x's by default; required with float8 x), "bias_dtype" (out's by default) and
// "blocks" (float8 block scales, core/block_scales.h; false by default) and "fast_accumulation" (tensor-scaled
// float8 only, GemmTypes; false by default).
inline GemmTypes gemm_types_arg(const pybind11::dict& c, const char* takes) {
  const auto named = [&](const char* key, DType fallback) {
    return c.contains(key) ? dtype_arg(c[key].cast<std::string>(), takes) : fallback;
  };
  const DType x = dtype_arg(c["dtype"].cast<std::string>(), takes);
  if (is_fp8(x) && !c.contains("out_dtype"))
    throw std::invalid_argument(std::string("jax_overlap: float8 x (") + dtype_name(x) + ") needs an out_dtype");
  const bool blocks = c.contains("blocks") && c["blocks"].cast<bool>();
  if (blocks && !is_fp8(x))
    throw std::invalid_argument(std::string("jax_overlap: block scales take float8 x, got ") + dtype_name(x));
  const bool fast = c.contains("fast_accumulation") && c["fast_accumulation"].cast<bool>();
  if (fast && (!is_fp8(x) || blocks))
    throw std::invalid_argument(std::string("jax_overlap: fast accumulation takes tensor-scaled float8 x, got ") +
                                dtype_name(x) + (blocks ? " with block scales" : ""));
  const DType out = named("out_dtype", x);
  return GemmTypes{x, named("w_dtype", x), out, named("bias_dtype", out), is_fp8(x), blocks, fast};
}

// The GEMM op a name from Python names (ag_matmul or matmul_rs); ValueError otherwise.
inline OpKind gemm_op_arg(const std::string& name) {
  if (name == op_name(OpKind::kAgMatmul)) return OpKind::kAgMatmul;
  if (name == op_name(OpKind::kMatmulRs)) return OpKind::kMatmulRs;
  throw std::invalid_argument("jax_overlap: no op " + name);
}

constexpr const char* kPipelinedTakes = "the pipelined algorithm takes";

// A pipelined call's shape from a call dict: "dtype" (and the others gemm_types_arg reads), "batch", "m", "k", "n",
// "w_kmajor", "stages" (kept in *stages, which the result points into), optionally "x_scale_shared".
inline pipelined::Operands call_shape(const pybind11::dict& c, bool bias, std::vector<int64_t>* stages) {
  pipelined::Operands o{};
  o.gemm = GemmProblem::dense(gemm_types_arg(c, kPipelinedTakes), c["batch"].cast<int64_t>(), c["m"].cast<int64_t>(),
                              c["k"].cast<int64_t>(), c["n"].cast<int64_t>(), c["w_kmajor"].cast<bool>(), bias);
  *stages = c["stages"].cast<std::vector<int64_t>>();
  o.stages = stages->data();
  o.stage_count = static_cast<int>(stages->size());
  o.x_scale_shared = c.contains("x_scale_shared") && c["x_scale_shared"].cast<bool>();
  return o;
}

// The copy path a timing or test names ("copy_engine", ...); none: the path initialize() verified on the
// GPU, or before it did, the first candidate (planning/figures.py's guess of the link precedes initialize()).
inline pipelined::CopyPath copy_path_of(int ordinal, const std::optional<std::string>& name) {
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

// The ids (blas/gemm.h problem_id) of `problems`, for Python.
inline std::vector<std::string> problem_ids(const std::vector<GemmProblem>& problems) {
  std::vector<std::string> ids;
  for (const GemmProblem& p : problems) ids.push_back(blas::problem_id(p));
  return ids;
}

// The problem a problem id names; ValueError for text that is not one.
inline GemmProblem problem_arg(const std::string& id) {
  GemmProblem p{};
  if (!blas::parse_problem_id(id, &p))
    throw std::invalid_argument("jax_overlap: not a GEMM problem id (blas/gemm.h problem_id): " + id);
  return p;
}

}  // namespace jo::bindings
