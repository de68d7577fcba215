// The Python module jax_overlap._native, bound by concern: csrc/module.cc's
// PYBIND11_MODULE calls each bind_* below on the module, and each lives in
// the file of that name here.
#pragma once

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "core/dtype.h"
#include "core/gemm_problem.h"
#include "core/op_kind.h"
#include "platform/status.h"

namespace jo::bindings {

// The FFI targets and their registrations, the build (registrations.cc).
void bind_registrations(pybind11::module_& m);
// The runtime jax_overlap/runtime/workspace.py drives: devices, workspaces, peers, errors, faults (runtime.cc).
void bind_runtime(pybind11::module_& m);
// The flag protocol's value rules, as the kernels apply them, for the CPU tests (protocol.cc).
void bind_protocol(pybind11::module_& m);
// The pipelined algorithm's sizes, copy paths, vendor GEMM set-up and timings (pipelined.cc).
void bind_pipelined(pybind11::module_& m);
// The fused kernels' compiled tiles and launch geometry, for jax_overlap/planning/fused.py (fused.cc).
void bind_fused(pybind11::module_& m);
// The simulated-rank harness of the GPU tests and benchmarks (testing.cc).
void bind_testing(pybind11::module_& m);

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

}  // namespace jo::bindings
