// Bindings of the runtime's test hooks (runtime/faults.h, runtime/runtime.h).
#include <pybind11/pybind11.h>

#include <string>

#include "pipelined/copy.h"
#include "runtime/faults.h"
#include "runtime/runtime.h"
#include "testing/bindings.h"

namespace py = pybind11;

namespace jo::bindings {

void bind_hooks(py::module_& m) {
  // "name[=value],...", "" for none.
  m.def("set_faults", [](const std::string& spec) { faults::set_spec(spec); }, py::arg("spec"));
  m.def("faults", [] { return faults::spec(); });
  // Region epoch counters start from `origin` (new regions, and all after clear_errors()).
  m.def("set_epoch_origin", [](uint64_t origin) { Runtime::instance().set_epoch_origin(origin); }, py::arg("origin"));
  m.def(
      "copy_path",
      [](int ordinal) -> py::object {
        const Workspace* ws = Runtime::instance().workspace(ordinal);
        pipelined::CopyPath path{};
        if (ws == nullptr || !Runtime::verified_copy_path(*ws, &path).ok()) return py::none();
        return py::str(pipelined::copy_path_name(path));
      },
      py::arg("ordinal"));
}

}  // namespace jo::bindings
