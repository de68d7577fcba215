// Bindings of the flag protocol's value rules, as the kernels apply them, for
// the CPU tests (tests/test_protocol.py).
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/bindings.h"
#include "kernels/params.h"
#include "kernels/pipeline_kernels.h"
#include "kernels/region_layout.h"

namespace py = pybind11;

namespace jo::bindings {

void bind_protocol(py::module_& m) {
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
