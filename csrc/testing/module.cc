// Python module jax_overlap._native_testing: the tests' and benchmarks' harness; the package never imports it.
#include <pybind11/pybind11.h>

#include "testing/bindings.h"

PYBIND11_MODULE(_native_testing, m) {
  m.doc() = "jax_overlap test and benchmark harness: simulated ranks, loopback timings, hooks, mirrored constants, "
            "the handlers' checks";
  jo::bindings::bind_contracts(m);
  jo::bindings::bind_hooks(m);
  jo::bindings::bind_blas(m);
  jo::bindings::bind_pipelined_harness(m);
  jo::bindings::bind_sim_group(m);
  jo::bindings::bind_handler_checks(m);
}
