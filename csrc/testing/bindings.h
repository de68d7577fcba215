// The harness module jax_overlap._native_testing, bound by concern: what the
// tests and benchmarks drive beside the package (csrc/testing/module.cc). It is
// built with jax_overlap._native over the same library (libjax_overlap_core), so
// both see one runtime: a fault set here fails the package's next call.
#pragma once

#include <pybind11/pybind11.h>

#include "bindings/bindings.h"

namespace jo::bindings {

// The values and rules the Python side mirrors, for the CPU tests to hold it to (bind_contracts.cc).
void bind_contracts(pybind11::module_& m);
// The runtime's test hooks: fault injection, epoch origins, the verified copy path (bind_hooks.cc).
void bind_hooks(pybind11::module_& m);
// The vendor GEMM's problems, plans, timings, tuning cache and counters (bind_blas.cc).
void bind_blas(pybind11::module_& m);
// The pipelined algorithm's copies and its schedule in loopback on one GPU (bind_pipelined.cc).
void bind_pipelined_harness(pybind11::module_& m);
// Simulated ranks on one GPU (bind_sim_group.cc).
void bind_sim_group(pybind11::module_& m);
// The FFI handlers' shared checks on a CPU: check_gemm on described buffers, EnqueueClaim from threads
// (bind_handler_checks.cc).
void bind_handler_checks(pybind11::module_& m);

// A GEMM problem's fields by name, and its id (blas/gemm.h problem_id) as "id" (bind_blas.cc).
pybind11::dict gemm_problem_dict(const GemmProblem& p);

}  // namespace jo::bindings
