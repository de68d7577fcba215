// Bindings of what the Python side mirrors, for the CPU tests to hold it to: the flag protocol's value rules as
// the kernels apply them (tests/test_protocol.py), the block scales' layout (jax_overlap/quantization/scaling.py),
// the largest group, the shapes the transposing fp8 cast takes (jax_overlap/ops/fp8_cast.py), and the fused
// kernels' scratch sizes.
#include <pybind11/pybind11.h>

#include <string>

#include "core/block_scales.h"
#include "core/scale_mode.h"
#include "kernels/fp8_cast.h"
#include "kernels/params.h"
#include "kernels/pipeline_kernels.h"
#include "kernels/region_layout.h"
#include "kernels/tile_registry.h"
#include "testing/bindings.h"

namespace py = pybind11;

namespace jo::bindings {

void bind_contracts(py::module_& m) {
  m.attr("MAX_WORLD") = kMaxWorld;
  m.attr("SCALE_BLOCK") = kScaleBlock;
  m.attr("SCALE_ROW_MULTIPLE") = kScaleRowMultiple;
  m.attr("W_SCALE_ROW_ALIGN") = kWScaleRowAlign;
  py::dict modes;  // the GEMM calls' scaling attribute (core/scale_mode.h), which Scaling.code mirrors
  for (ScaleMode mode : kScaleModes) modes[scale_mode_name(mode)] = static_cast<int64_t>(mode);
  m.attr("SCALE_MODES") = modes;
  m.def(
      "transposed_cast_declined",
      [](int64_t rows, int64_t cols) -> py::object {
        const char* why = transposed_cast_declined(rows, cols);
        return why == nullptr ? py::object(py::none()) : py::object(py::str(why));
      },
      py::arg("rows"), py::arg("cols"));
  m.def("tail_scratch_bytes", &tail_scratch_bytes, py::arg("tile"), py::arg("slots"));

  m.def("flag_value", &flag_value, py::arg("epoch"), py::arg("site"));
  m.def(
      "flag_match",
      [](uint32_t value, uint32_t expected) {
        static const char* const kNames[] = {"no", "yes", "other site"};
        return std::string(kNames[static_cast<int>(match(value, expected))]);
      },
      py::arg("value"), py::arg("expected"));
  m.def(
      "pipelined_flag_state",
      [](uint32_t epoch, uint32_t site, uint32_t want_epoch, uint32_t want_site) {
        static const char* const kNames[] = {"pending", "released", "other site", "abandoned"};
        return std::string(kNames[static_cast<int>(pipe_state(epoch, site, want_epoch, want_site))]);
      },
      py::arg("epoch"), py::arg("site"), py::arg("want_epoch"), py::arg("want_site"));
  m.def(
      "epoch_slot_used",
      [](uint64_t origin, uint64_t epoch) {
        EpochCounter c;
        c.restart(origin);
        return c.slot_used(epoch);
      },
      py::arg("origin"), py::arg("epoch"));
}

}  // namespace jo::bindings
