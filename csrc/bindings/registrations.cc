// Bindings of the FFI targets and their registrations, and of the build.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "core/block_scales.h"
#include "core/scale_mode.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/fp8_cast.h"
#include "kernels/params.h"
#include "platform/gpu.h"

#ifndef JAX_OVERLAP_ARCHS
#define JAX_OVERLAP_ARCHS "unknown"
#endif
#ifndef JAX_OVERLAP_COMPILER
#define JAX_OVERLAP_COMPILER "unknown"
#endif
#ifndef JAX_OVERLAP_FFI_API
#define JAX_OVERLAP_FFI_API "unknown"
#endif

namespace py = pybind11;

namespace jo::bindings {
namespace {

py::capsule capsule(XLA_FFI_Handler* fn) { return py::capsule(reinterpret_cast<void*>(fn)); }

}  // namespace

void bind_registrations(py::module_& m) {
  m.def("build_info", [] {
    py::dict d;
    d["platform"] = gpu::kPlatformName;
    d["archs"] = JAX_OVERLAP_ARCHS;
    d["compiler"] = JAX_OVERLAP_COMPILER;
    d["ffi_api"] = JAX_OVERLAP_FFI_API;
    d["fused_kernels"] = true;
    return d;
  });
  m.attr("MAX_WORLD") = kMaxWorld;
  // Block scales' layout (core/block_scales.h), which jax_overlap/quantization/scaling.py mirrors.
  m.attr("SCALE_BLOCK") = kScaleBlock;
  m.attr("SCALE_ROW_MULTIPLE") = kScaleRowMultiple;
  m.attr("W_SCALE_ROW_ALIGN") = kWScaleRowAlign;
  // The scaling modes of the GEMM calls' attributes (core/scale_mode.h), which Scaling.code mirrors.
  py::dict modes;
  for (ScaleMode mode : kScaleModes) modes[scale_mode_name(mode)] = static_cast<int64_t>(mode);
  m.attr("SCALE_MODES") = modes;
  // The shapes the transposing fp8 cast takes (kernels/fp8_cast.h), which jax_overlap/ops/fp8_cast.py mirrors.
  m.def(
      "transposed_cast_declined",
      [](int64_t rows, int64_t cols) -> py::object {
        const char* why = transposed_cast_declined(rows, cols);
        return why == nullptr ? py::object(py::none()) : py::object(py::str(why));
      },
      py::arg("rows"), py::arg("cols"));

  m.def("targets", [] {
    py::dict d;
    for (const FfiTarget& t : ffi_targets()) d[t.op] = t.target;
    return d;
  });
  m.def("registrations", [] {
    py::dict d;
    for (const FfiTarget& t : ffi_targets()) {
      py::dict stages;
      if (t.instantiate != nullptr) stages["instantiate"] = capsule(t.instantiate);
      stages["execute"] = capsule(t.execute);
      d[t.target] = stages;
    }
    return d;
  });
  m.def("type_registrations", [] {
    py::dict reg;
    reg["type_id"] = py::capsule(reinterpret_cast<void*>(&CallState::id));
    reg["type_info"] = py::capsule(const_cast<void*>(reinterpret_cast<const void*>(&kCallStateTypeInfo)));
    py::dict d;
    d["jax_overlap_call_state"] = reg;
    return d;
  });
}

}  // namespace jo::bindings
