#include "blas/capture_check.h"

#include <map>
#include <mutex>
#include <vector>

#include "blas/gemm.h"
#include "platform/device_scope.h"
#include "runtime/faults.h"

namespace jo::blas {
namespace {

// fp16 operands of small integers (|x|, |w|, |bias| <= 3, k = 64): every
// product and sum is an integer below 2048 in magnitude, exact in the fp32
// accumulator and in the fp16 output, so every correct algorithm gives the
// same bits, whatever order it sums in.
constexpr int64_t kRows = 64, kN = 64, kK = 64;

uint16_t fp16_bits(int v) {  // exact for |v| < 2048
  if (v == 0) return 0;
  const unsigned a = static_cast<unsigned>(v < 0 ? -v : v);
  const int e = 31 - __builtin_clz(a);
  const unsigned sign = v < 0 ? 0x8000u : 0u, exponent = static_cast<unsigned>(e + 15) << 10;
  return static_cast<uint16_t>(sign | exponent | ((a << (10 - e)) & 0x3FFu));
}

struct Operands {
  std::vector<int> x, w, bias;
  std::vector<uint16_t> expected;  // y = x @ w + bias, [kRows, kN]
};

Operands make_operands() {
  Operands o;
  uint32_t state = 12345;
  const auto next = [&] {  // -3 .. 3
    state = state * 1664525u + 1013904223u;
    return static_cast<int>(state >> 24) % 7 - 3;
  };
  for (int64_t i = 0; i < kRows * kK; ++i) o.x.push_back(next());
  for (int64_t i = 0; i < kK * kN; ++i) o.w.push_back(next());
  for (int64_t i = 0; i < kN; ++i) o.bias.push_back(next());
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kN; ++c) {
      int sum = o.bias[c];
      for (int64_t k = 0; k < kK; ++k) sum += o.x[r * kK + k] * o.w[k * kN + c];
      o.expected.push_back(fp16_bits(sum));
    }
  return o;
}

std::vector<uint16_t> to_fp16(const std::vector<int>& values) {
  std::vector<uint16_t> bits;
  for (int v : values) bits.push_back(fp16_bits(v));
  return bits;
}

// Device memory, a stream, a graph and its executable, all released at scope exit.
struct Resources {
  char* memory = nullptr;
  hipStream_t stream = nullptr;
  hipGraph_t graph = nullptr;
  hipGraphExec_t exec = nullptr;
  ~Resources() {
    if (stream) (void)hipStreamSynchronize(stream);
    if (exec) (void)hipGraphExecDestroy(exec);
    if (graph) (void)hipGraphDestroy(graph);
    if (stream) (void)hipStreamDestroy(stream);
    if (memory) (void)hipFree(memory);
  }
};

// Runs the check; `out` says whether the graph replayed right.
Status run_check(int ordinal, CaptureCheck* out) {
  DeviceBlas* blas = nullptr;
  JO_RETURN_IF_ERROR(DeviceBlas::prepare(ordinal, &blas));
  std::lock_guard<std::mutex> tool(blas->tool_mu());  // its GEMMs run on the tools' handle
  DeviceScope scope(ordinal);  // restored after r's release
  JO_RETURN_IF_HIP_ERROR(scope.status());
  Resources r;
  const Operands o = make_operands();
  constexpr size_t kElem = element_bytes(DType::kF16);
  constexpr size_t kXBytes = kRows * kK * kElem, kWBytes = kK * kN * kElem, kBiasBytes = 256,
                   kYBytes = kRows * kN * kElem;
  JO_RETURN_IF_HIP_ERROR(hipMalloc(reinterpret_cast<void**>(&r.memory),
                                   kXBytes + kWBytes + kBiasBytes + kYBytes + kWorkspaceBytes));
  char* x = r.memory;
  char* w = x + kXBytes;
  char* bias = w + kWBytes;
  char* y = bias + kBiasBytes;
  char* workspace = y + kYBytes;
  JO_RETURN_IF_HIP_ERROR(hipMemcpy(x, to_fp16(o.x).data(), kXBytes, hipMemcpyHostToDevice));
  JO_RETURN_IF_HIP_ERROR(hipMemcpy(w, to_fp16(o.w).data(), kWBytes, hipMemcpyHostToDevice));
  JO_RETURN_IF_HIP_ERROR(hipMemcpy(bias, to_fp16(o.bias).data(), kN * kElem, hipMemcpyHostToDevice));
  JO_RETURN_IF_HIP_ERROR(hipStreamCreateWithFlags(&r.stream, hipStreamNonBlocking));
  GemmProblem shape = GemmProblem::dense(GemmTypes::same(DType::kF16), /*batch=*/1, kRows, kK, kN,
                                         /*w_kmajor=*/false, /*bias=*/true);
  shape.alignment = alignment_of({x, w, bias, y});
  const auto gemm = [&]() -> Status {
    const GemmPlan* plan = nullptr;
    JO_RETURN_IF_ERROR(blas->plan(shape, &plan));
    return blas->run(*plan, GemmPointers{x, w, bias, nullptr, nullptr, y}, workspace, r.stream, blas->tool_handle());
  };
  const auto poison = [&]() -> Status {  // NaN, so that an output left unwritten shows
    JO_RETURN_IF_HIP_ERROR(hipMemsetAsync(y, 0xFF, kYBytes, r.stream));
    return {};
  };
  const auto wrong_outputs = [&](int* wrong) -> Status {
    std::vector<uint16_t> got(kRows * kN);
    JO_RETURN_IF_HIP_ERROR(hipStreamSynchronize(r.stream));
    JO_RETURN_IF_HIP_ERROR(hipMemcpy(got.data(), y, kYBytes, hipMemcpyDeviceToHost));
    *wrong = 0;
    for (size_t i = 0; i < got.size(); ++i) *wrong += got[i] != o.expected[i] ? 1 : 0;
    return {};
  };
  const auto unsafe = [&](const std::string& why) {
    (void)hipGetLastError();  // a failed capture's error is the verdict, not the next call's
    out->graph_safe = false;
    out->detail = why;
    return Status{};
  };

  JO_RETURN_IF_ERROR(poison());
  const hipError_t began = hipStreamBeginCapture(r.stream, hipStreamCaptureModeThreadLocal);
  if (began != hipSuccess) return unsafe(std::string("capture could not begin: ") + hipGetErrorString(began));
  const Status captured = gemm();
  const hipError_t ended = hipStreamEndCapture(r.stream, &r.graph);
  if (!captured.ok()) return unsafe("the GEMM could not be captured: " + captured.message);
  if (ended != hipSuccess) return unsafe(std::string("the capture failed: ") + hipGetErrorString(ended));
  const hipError_t instantiated = hipGraphInstantiateWithFlags(&r.exec, r.graph, 0);
  if (instantiated != hipSuccess)
    return unsafe(std::string("the captured graph could not be instantiated: ") + hipGetErrorString(instantiated));
  for (int replay = 1; replay <= 2; ++replay) {
    JO_RETURN_IF_ERROR(poison());
    // Fault capture_check_fails: the replays are not launched, so the output keeps its poison and the check
    // fails as it does for a graph that does not replay right (the failure path, on a GPU where it replays).
    if (!faults::enabled("capture_check_fails")) {
      const hipError_t launched = hipGraphLaunch(r.exec, r.stream);
      if (launched != hipSuccess)
        return unsafe(std::string("replaying the graph failed: ") + hipGetErrorString(launched));
    }
    int wrong = 0;
    JO_RETURN_IF_ERROR(wrong_outputs(&wrong));
    if (wrong != 0)
      return unsafe("replay " + std::to_string(replay) + " of the captured GEMM left " + std::to_string(wrong) +
                    " of " + std::to_string(kRows * kN) + " outputs wrong");
  }
  JO_RETURN_IF_ERROR(poison());
  JO_RETURN_IF_ERROR(gemm());
  int wrong = 0;
  JO_RETURN_IF_ERROR(wrong_outputs(&wrong));
  if (wrong != 0)
    return Status{"jax_overlap: the vendor GEMM on GPU " + std::to_string(ordinal) + " computed " +
                  std::to_string(wrong) + " of " + std::to_string(kRows * kN) +
                  " outputs of an exact fp16 product wrong, outside any graph"};
  out->graph_safe = true;
  out->detail.clear();
  return {};
}

struct Verdict {
  std::string faults;  // the faults in effect when it was taken
  CaptureCheck check;
};

std::mutex verdicts_mu;
std::map<int, Verdict> verdicts;  // device ordinal -> its latest verdict

}  // namespace

Status check_graph_capture(int ordinal, CaptureCheck* out) {
  std::lock_guard<std::mutex> lock(verdicts_mu);
  const std::string spec = faults::spec();
  auto it = verdicts.find(ordinal);
  if (it != verdicts.end() && it->second.faults == spec) {
    *out = it->second.check;
    out->checked_now = false;
    return {};
  }
  CaptureCheck check;
  JO_RETURN_IF_ERROR(run_check(ordinal, &check));
  check.checked_now = true;
  verdicts[ordinal] = Verdict{spec, check};
  *out = check;
  return {};
}

bool graph_capture_safe() {
  std::lock_guard<std::mutex> lock(verdicts_mu);
  const std::string spec = faults::spec();
  for (const auto& [ordinal, v] : verdicts)
    if (v.faults == spec && !v.check.graph_safe) return false;
  return true;
}

}  // namespace jo::blas
