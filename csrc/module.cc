// Python module jax_overlap._native: one binder per concern (bindings/bindings.h).
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"

PYBIND11_MODULE(_native, m) {
  m.doc() = "jax_overlap native extension: FFI handlers, runtime, planning queries";
  jo::bindings::bind_registrations(m);
  jo::bindings::bind_runtime(m);
  jo::bindings::bind_pipelined(m);
  jo::bindings::bind_fused(m);
}
