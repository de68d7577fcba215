// Bindings that run the FFI handlers' shared checks (ffi/common.h) on a CPU, where the handlers themselves never
// run: check_gemm on buffers described by dtype and shape (XLA's own XLA_FFI_Buffer structs, no data), and
// EnqueueClaim taken from several host threads. The GPU tests reach the same code only through XLA's execute path.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ffi/common.h"
#include "testing/bindings.h"

namespace py = pybind11;

namespace jo::bindings {

namespace {

// A buffer as Python describes it: jax's name of its dtype ("float8_e4m3fn", "int8", ...) and its dimensions.
using BufferDesc = std::pair<std::string, std::vector<int64_t>>;

// The XLA data type jax names `name`, through data_type_name itself so that the two agree; ValueError otherwise.
ffi::DataType data_type_arg(const std::string& name) {
  // XLA_FFI_DataType numbers its types below 64 (c_api.h).
  for (int value = 1; value < 64; ++value) {
    const auto t = static_cast<ffi::DataType>(value);
    if (data_type_name(t) == name) return t;
  }
  throw std::invalid_argument("jax_overlap: no XLA data type is named " + name);
}

// An XLA_FFI_Buffer as XLA hands one to a handler, without data: the checks read dtypes and shapes only.
class DescribedBuffer {
 public:
  explicit DescribedBuffer(const BufferDesc& desc) : dims_(desc.second) {
    buf_.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    buf_.extension_start = nullptr;
    buf_.dtype = static_cast<XLA_FFI_DataType>(data_type_arg(desc.first));
    buf_.data = nullptr;
    buf_.rank = static_cast<int64_t>(dims_.size());
    buf_.dims = dims_.data();
  }
  // any_ points into this object.
  DescribedBuffer(const DescribedBuffer&) = delete;
  DescribedBuffer& operator=(const DescribedBuffer&) = delete;

  const ffi::AnyBuffer& any() const { return any_; }

 private:
  std::vector<int64_t> dims_;
  XLA_FFI_Buffer buf_{};
  ffi::AnyBuffer any_{&buf_};
};

// The buffer of an optional description; none for none.
void describe(const std::optional<BufferDesc>& desc, std::optional<DescribedBuffer>* out) {
  if (desc) out->emplace(*desc);
}
const ffi::AnyBuffer* any_or_null(const std::optional<DescribedBuffer>& b) { return b ? &b->any() : nullptr; }

// An error as XLA's runtime error prints it ("INVALID_ARGUMENT: jax_overlap ..."); "" for success.
std::string error_text(const ffi::Error& e) {
  if (e.success()) return "";
  // absl::StatusCode's names, whose numbers XLA_FFI_Error_Code's are.
  static const char* const kCodes[] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
      "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
      "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const auto code = static_cast<size_t>(*e.errc());
  const std::string name = code < std::size(kCodes) ? kCodes[code] : "error code " + std::to_string(code);
  return name + ": " + e.message();
}

// Until `turn` reaches `until`.
void wait_for(const std::atomic<int>& turn, int until) {
  while (turn.load() < until) std::this_thread::yield();
}

}  // namespace

void bind_handler_checks(py::module_& m) {
  m.attr("MAX_LOCAL_DEVICES") = kMaxLocalDevices;
  // jo::check_gemm, as handler `op` calls it, on buffers described as (dtype name, dims): x_scale and w_scale
  // None for the targets that take no scales (the fused kernels'), like_x the gathered x of an ag_matmul (None
  // for none). The problem as gemm_problem_fields gives it, or the error as XLA's runtime error prints it.
  m.def(
      "check_gemm",
      [](const std::string& op, const BufferDesc& x, const BufferDesc& w, const BufferDesc& bias,
         const std::optional<BufferDesc>& x_scale, const std::optional<BufferDesc>& w_scale, const BufferDesc& y,
         const std::optional<BufferDesc>& like_x, bool w_kmajor, int64_t scaling,
         bool fast_accumulation) -> py::object {
        const DescribedBuffer xb(x), wb(w), bias_b(bias), yb(y);
        std::optional<DescribedBuffer> xs, ws, gathered;
        describe(x_scale, &xs);
        describe(w_scale, &ws);
        describe(like_x, &gathered);
        const GemmArgs args{xb.any(), wb.any(), bias_b.any(), any_or_null(xs), any_or_null(ws)};
        // The handlers pass their gathered results as an initializer list: none, or ag_matmul's one.
        const auto checked = gathered ? check_gemm(op.c_str(), args, yb.any(), {&gathered->any()}, w_kmajor, scaling,
                                                   fast_accumulation)
                                      : check_gemm(op.c_str(), args, yb.any(), {}, w_kmajor, scaling,
                                                   fast_accumulation);
        if (checked.has_error()) return py::str(error_text(checked.error()));
        return gemm_problem_dict(checked.value());
      },
      py::arg("op"), py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("x_scale"), py::arg("w_scale"),
      py::arg("y"), py::arg("like_x") = py::none(), py::arg("w_kmajor") = false, py::arg("scaling") = 0,
      py::arg("fast_accumulation") = false);
  // One host thread per entry of `ordinals` takes an EnqueueClaim on that GPU, as handler `op`'s execute does,
  // each in turn (so the first on each GPU is the one that holds it). hold: each keeps a claim it got until every
  // thread has claimed (a refused claim is dropped at once, as its handler returns); otherwise each releases before
  // the next claims. Per thread: its Linux thread id and its claim's status as error_text gives it ("" when it
  // held the GPU).
  m.def(
      "enqueue_claims",
      [](const std::string& op, const std::vector<int32_t>& ordinals, bool hold) {
        const int count = static_cast<int>(ordinals.size());
        std::vector<uint64_t> threads(ordinals.size());
        std::vector<std::string> statuses(ordinals.size());
        std::atomic<int> turn{0};  // the thread whose turn it is to claim; count when all have
        const auto claim = [&](int i) {
          threads[i] = static_cast<uint64_t>(syscall(SYS_gettid));
          wait_for(turn, i);
          std::optional<EnqueueClaim> held;
          held.emplace(ordinals[i]);
          statuses[i] = error_text(held->status(op.c_str()));
          if (!hold || !statuses[i].empty()) held.reset();
          turn.store(i + 1);
          wait_for(turn, count);
        };
        {
          py::gil_scoped_release release;
          std::vector<std::thread> running;
          for (int i = 0; i < count; ++i) running.emplace_back(claim, i);
          for (std::thread& t : running) t.join();
        }
        py::list out;
        for (int i = 0; i < count; ++i) out.append(py::make_tuple(threads[i], statuses[i]));
        return out;
      },
      py::arg("op"), py::arg("ordinals"), py::arg("hold"));
}

}  // namespace jo::bindings
