// The sm90 persistent GEMM (csrc/gemm/sm90) alone against cuBLASLt on one
// Hopper GPU, before any transport feeds it.
//
// Checks: float64 host references on small odd shapes (bias, bf16 and fp32
// output), cuBLASLt on the large and odd shapes; the output is poisoned with
// NaN before every checked launch and NaNs are counted.
// Times: per launch of 30 launched back to back (events between), median, after
// 5 warm-up launches; cuBLASLt's 8 best heuristic candidates are each timed the
// same way ("cublasLt best" is the fastest of them, "cublasLt heur" the first).
// The chunk gate, 4 chunks of rows walked from chunk 1:
// - "gate, flags set": flags released before the launch (the fused kernels'
//   world-1 target);
// - "gate, flags late": released after the launch by 4-byte host-to-device
//   copies on another stream, in walk order;
// - "gate, rows late": x poisoned, each chunk's rows copied from pinned host
//   memory on another stream and then its flag: the result must be bitwise the
//   prompt one, the time is set by the copies ("copies alone" beside it).
// Build and run: bash benchmarks/gemm_engine/run_sm90.sh
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "check.h"
#include "timing.h"
#include "gemm/sm90/gemm.h"

using jo::gemm::sm90::Gemm;
using jo::gemm::sm90::GemmParams;
using bf16 = __nv_bfloat16;
using fp8 = __nv_fp8_e4m3;

constexpr int kChunks = 4, kOwnChunk = 1;

template <class T>
__global__ void fill_normal(T* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;  // splitmix64
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    const float u1 = (float(h >> 40) + 1.f) / 16777217.f, u2 = float(h & 0xFFFFFF) / 16777216.f;
    p[i] = T(scale * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

// T is bf16 or float. sums[0] += (y - ref)^2, sums[1] += ref^2, sums[2] += NaNs in y, sums[3] += bitwise differences
template <class T>
__global__ void compare(const T* y, const T* ref, size_t n, double* sums) {
  double d2 = 0, r2 = 0, nan = 0, diff = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const double a = static_cast<float>(y[i]), b = static_cast<float>(ref[i]);
    if (a != a) nan += 1;
    else d2 += (a - b) * (a - b);
    r2 += b * b;
    if constexpr (sizeof(T) == 2) diff += __bfloat16_as_ushort(y[i]) != __bfloat16_as_ushort(ref[i]);
    else diff += __float_as_uint(y[i]) != __float_as_uint(ref[i]);
  }
  atomicAdd(&sums[0], d2);
  atomicAdd(&sums[1], r2);
  atomicAdd(&sums[2], nan);
  atomicAdd(&sums[3], diff);
}

struct Cmp {
  double rel_err, nans, diffs;
};

template <class T>
static Cmp compare_dev(const T* y, const T* ref, size_t n) {
  double* sums;
  CHECK(cudaMalloc(&sums, 4 * sizeof(double)));
  CHECK(cudaMemset(sums, 0, 4 * sizeof(double)));
  compare<<<1024, 256>>>(y, ref, n, sums);
  CHECK(cudaGetLastError());
  double h[4];
  CHECK(cudaMemcpy(h, sums, sizeof(h), cudaMemcpyDeviceToHost));
  CHECK(cudaFree(sums));
  return {std::sqrt(h[0] / h[1]), h[2], h[3]};
}

// cuBLASLt y[M,N] = x[M,K] w[N,K]^T (+ bias) in its column-major terms:
// y^T [N,M] = (w as K x N)^T (x as K x M). Out is bf16 or fp32.
struct Lt {
  cublasLtHandle_t h;
  void* ws;
  size_t ws_bytes = 64 << 20;
  Lt() {
    CHECK(cublasLtCreate(&h));
    CHECK(cudaMalloc(&ws, ws_bytes));
  }
  ~Lt() {
    cudaFree(ws);
    cublasLtDestroy(h);
  }
  struct Plan {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    std::vector<cublasLtMatmulHeuristicResult_t> algos;
  };
  // fp8 (in = CUDA_R_8F_E4M3): tensor scales from device pointers; fast_accum
  // keeps the tensor cores' own accumulation, as the sm90 kernel does.
  Plan plan(int M, int N, int K, cudaDataType out, const void* bias, cudaDataType in = CUDA_R_16BF,
            const float* scale_a = nullptr, const float* scale_b = nullptr, bool fast_accum = false) {
    Plan p;
    CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (scale_a != nullptr) {
      CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof(scale_a)));
      CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof(scale_b)));
    }
    const int8_t fast = fast_accum;
    if (in != CUDA_R_16BF)
      CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
    if (bias != nullptr) {
      const cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BIAS;
      CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
      CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
      CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &out, sizeof(out)));
    }
    CHECK(cublasLtMatrixLayoutCreate(&p.a, in, K, N, K));
    CHECK(cublasLtMatrixLayoutCreate(&p.b, in, K, M, K));
    CHECK(cublasLtMatrixLayoutCreate(&p.c, out, N, M, N));
    cublasLtMatmulPreference_t pref;
    CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                               sizeof(ws_bytes)));
    p.algos.resize(8);
    int found = 0;
    CHECK(cublasLtMatmulAlgoGetHeuristic(h, p.op, p.a, p.b, p.c, p.c, pref, 8, p.algos.data(), &found));
    p.algos.resize(found);
    CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (found == 0)
      std::printf("cublasLt: no algorithm for %dx%dx%d (%s)\n", M, N, K, in == CUDA_R_16BF ? "bf16" : "fp8");
    return p;
  }
  cublasStatus_t try_run(const Plan& p, int i, const void* x, const void* w, void* y) {
    const float one = 1.f, zero = 0.f;
    return cublasLtMatmul(h, p.op, &one, w, p.a, x, p.b, &zero, y, p.c, y, p.c, &p.algos[i].algo, ws, ws_bytes, 0);
  }
  void run(const Plan& p, int i, const void* x, const void* w, void* y) { CHECK(try_run(p, i, x, w, y)); }
  // Each candidate that runs (a heuristic candidate can still be refused: status 15, not supported).
  std::vector<float> time_all(const Plan& p, const void* x, const void* w, void* y);
};

std::vector<float> Lt::time_all(const Plan& p, const void* x, const void* w, void* y) {
  std::vector<float> ms;
  for (size_t i = 0; i < p.algos.size(); ++i)
    if (try_run(p, i, x, w, y) == CUBLAS_STATUS_SUCCESS) ms.push_back(time_b2b([&] { run(p, i, x, w, y); }));
  return ms;
}

template <int BN, int S, class Out = bf16, class In = bf16>
static void launch(const In* x, const In* w, const GemmParams<Out>& p, int sms, cudaStream_t s = 0) {
  char err[512];
  if (Gemm<In, Out, BN, S>::launch(x, w, p, sms, s, err, sizeof(err)) != 0) {
    std::fprintf(stderr, "%s\n", err);
    std::exit(1);
  }
}

template <class Out>
static GemmParams<Out> params(Out* y, int M, int N, int K, const Out* bias = nullptr) {
  return {y, bias, 1.f, M, N, K, nullptr, 0, M, 0, nullptr, 0};
}

struct Row {
  char name[48];
  int M, N, K;
  float ms;
  double ratio;  // cuBLASLt's best time over this one
};
static std::vector<Row> table;
static void add(const char* name, int M, int N, int K, float ms, float base) {
  Row r{};
  std::snprintf(r.name, sizeof(r.name), "%s", name);
  r.M = M, r.N = N, r.K = K, r.ms = ms, r.ratio = base / ms;
  table.push_back(r);
}

static int failures = 0;
static void verdict(const char* what, int M, int N, int K, Cmp c, double tol) {
  const bool ok = c.nans == 0 && c.rel_err < tol;
  failures += !ok;
  std::printf("check %-36s %6d %6d %6d  relerr %.2e  nan %.0f  %s\n", what, M, N, K, c.rel_err, c.nans,
              ok ? "PASS" : "FAIL");
}

// Small shapes against float64 on the host: tails in M, N and K, odd N, bias,
// bf16 and fp32 output, both tile widths.
static void check_host(int M, int N, int K, int sms) {
  bf16 *x, *w, *bias, *y;
  float* yf;
  CHECK(cudaMalloc(&x, size_t(M) * K * 2));
  CHECK(cudaMalloc(&w, size_t(N) * K * 2));
  CHECK(cudaMalloc(&bias, size_t(N) * 2));
  CHECK(cudaMalloc(&y, size_t(M) * N * 2));
  CHECK(cudaMalloc(&yf, size_t(M) * N * 4));
  fill_normal<<<256, 256>>>(x, size_t(M) * K, 11 + M, 1.f);
  fill_normal<<<256, 256>>>(w, size_t(N) * K, 12 + N, 1.f);
  fill_normal<<<256, 256>>>(bias, N, 13 + K, 1.f);
  std::vector<bf16> hx(size_t(M) * K), hw(size_t(N) * K), hb(N);
  CHECK(cudaMemcpy(hx.data(), x, hx.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hw.data(), w, hw.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hb.data(), bias, hb.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<double> ref(size_t(M) * N);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = double(__bfloat162float(hb[n]));
      for (int k = 0; k < K; ++k)
        s += double(__bfloat162float(hx[size_t(m) * K + k])) * double(__bfloat162float(hw[size_t(n) * K + k]));
      ref[size_t(m) * N + n] = s;
    }
  auto host_cmp = [&](auto* dev, const char* what, double tol) {
    using T = std::remove_pointer_t<decltype(dev)>;
    std::vector<T> h(size_t(M) * N);
    CHECK(cudaMemcpy(h.data(), dev, h.size() * sizeof(T), cudaMemcpyDeviceToHost));
    double d2 = 0, r2 = 0, nans = 0;
    for (size_t i = 0; i < h.size(); ++i) {
      const double v = double(static_cast<float>(h[i]));
      if (v != v) ++nans;
      else d2 += (v - ref[i]) * (v - ref[i]);
      r2 += ref[i] * ref[i];
    }
    verdict(what, M, N, K, {std::sqrt(d2 / r2), nans, 0}, tol);
  };
  CHECK(cudaMemset(y, 0xFF, size_t(M) * N * 2));
  launch<256, 4>(x, w, params(y, M, N, K, bias), sms);
  host_cmp(y, "vs float64: 128x256 bf16 out, bias", 1e-2);
  CHECK(cudaMemset(y, 0xFF, size_t(M) * N * 2));
  launch<128, 6>(x, w, params(y, M, N, K, bias), sms);
  host_cmp(y, "vs float64: 128x128 bf16 out, bias", 1e-2);
  CHECK(cudaMemset(yf, 0xFF, size_t(M) * N * 4));
  std::vector<float> hbf(N);
  for (int n = 0; n < N; ++n) hbf[n] = __bfloat162float(hb[n]);
  float* biasf;
  CHECK(cudaMalloc(&biasf, size_t(N) * 4));
  CHECK(cudaMemcpy(biasf, hbf.data(), size_t(N) * 4, cudaMemcpyHostToDevice));
  launch<256, 4, float>(x, w, params<float>(yf, M, N, K, biasf), sms);
  host_cmp(yf, "vs float64: 128x256 fp32 out, bias", 1e-4);
  for (void* p : {(void*)x, (void*)w, (void*)bias, (void*)y, (void*)yf, (void*)biasf}) CHECK(cudaFree(p));
}

// fp8 e4m3 with tensor scales, bf16 out, against cuBLASLt fp8 (fast
// accumulation: the tensor cores' own, as here; and cuBLASLt's default).
static void fp8_section(Lt& lt, int M, int N, int K, int sms) {
  if (K % 16 != 0) return;  // TMA needs rows of whole 16-byte units
  fp8 *x, *w;
  bf16 *y, *ref;
  float* scales;
  CHECK(cudaMalloc(&x, size_t(M) * K));
  CHECK(cudaMalloc(&w, size_t(N) * K));
  CHECK(cudaMalloc(&y, size_t(M) * N * 2));
  CHECK(cudaMalloc(&ref, size_t(M) * N * 2));
  CHECK(cudaMalloc(&scales, 2 * sizeof(float)));
  const float h_scales[2] = {0.5f, 0.02f};
  CHECK(cudaMemcpy(scales, h_scales, sizeof(h_scales), cudaMemcpyHostToDevice));
  fill_normal<<<1024, 256>>>(x, size_t(M) * K, 3 + M, 2.f);
  fill_normal<<<1024, 256>>>(w, size_t(N) * K, 4 + N, 2.f);
  auto fast = lt.plan(M, N, K, CUDA_R_16BF, nullptr, CUDA_R_8F_E4M3, scales + 1, scales, true);
  auto slow = lt.plan(M, N, K, CUDA_R_16BF, nullptr, CUDA_R_8F_E4M3, scales + 1, scales, false);
  // cuBLASLt refused its first fp8 candidate on an H100 (status 15): the reference is the first that runs.
  size_t first = 0;
  while (first < fast.algos.size() && lt.try_run(fast, first, x, w, ref) != CUBLAS_STATUS_SUCCESS) ++first;
  if (first == fast.algos.size()) {
    std::printf("cublasLt: no fp8 candidate runs at %dx%dx%d\n", M, N, K);
    return;
  }
  GemmParams<bf16> p = params(y, M, N, K);
  p.alpha = h_scales[0] * h_scales[1];
  auto k256 = [&] { launch<256, 4>(x, w, p, sms); };
  auto k128 = [&] { launch<128, 6>(x, w, p, sms); };
  for (auto [what, f] : {std::pair<const char*, std::function<void()>>{"vs cublasLt fp8: 128x256 s4", k256},
                         {"vs cublasLt fp8: 128x128 s6", k128}}) {
    CHECK(cudaMemset(y, 0xFF, size_t(M) * N * 2));
    f();
    CHECK(cudaDeviceSynchronize());
    verdict(what, M, N, K, compare_dev(y, ref, size_t(M) * N), 1e-2);
  }
  if (M < 1024 || M % 128 != 0) {
    for (void* q : {(void*)x, (void*)w, (void*)y, (void*)ref, (void*)scales}) CHECK(cudaFree(q));
    return;
  }
  const std::vector<float> fast_ms = lt.time_all(fast, x, w, ref), slow_ms = lt.time_all(slow, x, w, ref);
  if (fast_ms.empty()) return;
  const float best = *std::min_element(fast_ms.begin(), fast_ms.end());
  add("fp8 cublasLt fast-accum best", M, N, K, best, best);
  if (!slow_ms.empty())
    add("fp8 cublasLt default best", M, N, K, *std::min_element(slow_ms.begin(), slow_ms.end()), best);
  add("fp8 sm90 128x256 s4", M, N, K, time_b2b(k256), best);
  add("fp8 sm90 128x128 s6", M, N, K, time_b2b(k128), best);
  for (void* q : {(void*)x, (void*)w, (void*)y, (void*)ref, (void*)scales}) CHECK(cudaFree(q));
}

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a later failure keeps the lines before it
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs\n", prop.name, sms);
  check_host(200, 300, 264, sms);
  check_host(333, 517, 1000, sms);
  check_host(129, 257, 72, sms);

  Lt lt;
  cudaStream_t side;
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  uint32_t *flags, *error, *h_epochs;
  CHECK(cudaMalloc(&flags, kChunks * 4));
  CHECK(cudaMalloc(&error, 4));
  CHECK(cudaMemset(error, 0, 4));
  CHECK(cudaMallocHost(&h_epochs, 4 * 1024));
  uint32_t epoch = 0;

  const int shapes[][3] = {{16384, 3584, 8192}, {16384, 8192, 3584}, {4096, 3584, 8192},
                           {1024, 3584, 8192},  {1000, 3576, 8184}};
  for (auto& s : shapes) {
    if (std::getenv("JO_SM90_FP8_ONLY")) break;
    const int M = s[0], N = s[1], K = s[2];
    const bool timed = M >= 1024 && M % (128 * kChunks) == 0;
    bf16 *x, *w, *y, *ref, *prompt;
    CHECK(cudaMalloc(&x, size_t(M) * K * 2));
    CHECK(cudaMalloc(&w, size_t(N) * K * 2));
    CHECK(cudaMalloc(&y, size_t(M) * N * 2));
    CHECK(cudaMalloc(&ref, size_t(M) * N * 2));
    CHECK(cudaMalloc(&prompt, size_t(M) * N * 2));
    fill_normal<<<1024, 256>>>(x, size_t(M) * K, 1 + M, 1.f);
    fill_normal<<<1024, 256>>>(w, size_t(N) * K, 2 + N, 0.05f);
    auto plan = lt.plan(M, N, K, CUDA_R_16BF, nullptr);
    if (plan.algos.empty()) continue;
    lt.run(plan, 0, x, w, ref);
    CHECK(cudaDeviceSynchronize());

    auto checked = [&](const char* what, const std::function<void()>& f) {
      CHECK(cudaMemset(y, 0xFF, size_t(M) * N * 2));
      f();
      CHECK(cudaDeviceSynchronize());
      verdict(what, M, N, K, compare_dev(y, ref, size_t(M) * N), 1e-2);
    };
    auto plain256 = [&] { launch<256, 4>(x, w, params(y, M, N, K), sms); };
    auto plain128 = [&] { launch<128, 6>(x, w, params(y, M, N, K), sms); };
    checked("vs cublasLt: 128x256 s4", plain256);
    checked("vs cublasLt: 128x128 s6", plain128);
    if (!timed) {
      for (void* p : {(void*)x, (void*)w, (void*)y, (void*)ref, (void*)prompt}) CHECK(cudaFree(p));
      continue;
    }

    const int chunk_rows = M / kChunks;
    auto gated = [&](uint32_t e) {
      GemmParams<bf16> p = params(y, M, N, K);
      p.flags = flags;
      p.epoch = e;
      p.chunk_rows = chunk_rows;
      p.own_chunk = kOwnChunk;
      p.error = error;
      p.watchdog_ns = 2000000000u;
      return p;
    };
    auto set_flags = [&](uint32_t v) {
      std::vector<uint32_t> h(kChunks, v);
      CHECK(cudaMemcpy(flags, h.data(), kChunks * 4, cudaMemcpyHostToDevice));
    };
    // Flags released before the launch.
    set_flags(++epoch);
    const uint32_t prompt_epoch = epoch;
    checked("vs cublasLt: gate, flags set", [&] { launch<256, 4>(x, w, gated(prompt_epoch), sms); });
    CHECK(cudaMemcpy(prompt, y, size_t(M) * N * 2, cudaMemcpyDeviceToDevice));
    // Flags released after the launch, chunk by chunk in walk order, on the side stream.
    cudaEvent_t launched;
    CHECK(cudaEventCreateWithFlags(&launched, cudaEventDisableTiming));
    auto release_late = [&](bf16* rows_dst, const bf16* rows_src) {
      const uint32_t e = ++epoch;
      h_epochs[e % 1024] = e;
      // The side stream follows what precedes the launch (the poisoning of x),
      // never the launch itself, which waits for the side stream's flags.
      CHECK(cudaEventRecord(launched, 0));
      CHECK(cudaStreamWaitEvent(side, launched));
      launch<256, 4>(x, w, gated(e), sms);
      for (int i = 0; i < kChunks; ++i) {
        const int c = (kOwnChunk + i) % kChunks;
        if (rows_dst != nullptr)
          CHECK(cudaMemcpyAsync(rows_dst + size_t(c) * chunk_rows * K, rows_src + size_t(c) * chunk_rows * K,
                                size_t(chunk_rows) * K * 2, cudaMemcpyHostToDevice, side));
        CHECK(cudaMemcpyAsync(flags + c, &h_epochs[e % 1024], 4, cudaMemcpyHostToDevice, side));
      }
    };
    auto flags_late = [&] {
      release_late(nullptr, nullptr);
      CHECK(cudaStreamSynchronize(side));
    };
    checked("vs cublasLt: gate, flags late", flags_late);
    bf16* h_x;
    CHECK(cudaMallocHost(&h_x, size_t(M) * K * 2));
    CHECK(cudaMemcpy(h_x, x, size_t(M) * K * 2, cudaMemcpyDeviceToHost));
    auto rows_late = [&] {
      CHECK(cudaMemset(x, 0xFF, size_t(M) * K * 2));
      release_late(x, h_x);
    };
    checked("vs cublasLt: gate, rows late", rows_late);
    const Cmp bits = compare_dev(y, prompt, size_t(M) * N);
    failures += bits.diffs != 0;
    std::printf("check %-36s %6d %6d %6d  %.0f elements differ from the prompt launch  %s\n",
                "gate, rows late: bitwise", M, N, K, bits.diffs, bits.diffs == 0 ? "PASS" : "FAIL");
    uint32_t herr = 0;
    CHECK(cudaMemcpy(&herr, error, 4, cudaMemcpyDeviceToHost));
    if (herr != 0) {
      std::printf("check watchdog fired: chunk %u\n", herr - 1);
      ++failures;
    }

    auto add = [&](const char* name, float ms, float base) { ::add(name, M, N, K, ms, base); };
    const std::vector<float> lt_ms = lt.time_all(plan, x, w, ref);
    if (lt_ms.empty()) continue;
    const float best = *std::min_element(lt_ms.begin(), lt_ms.end());
    add("cublasLt best of 8", best, best);
    add("cublasLt first that runs", lt_ms[0], best);
    add("sm90 128x256 s4", time_b2b(plain256), best);
    add("sm90 128x128 s6", time_b2b(plain128), best);
    add("sm90 128x256 gate, flags set", time_b2b([&] { launch<256, 4>(x, w, gated(prompt_epoch), sms); }), best);
    add("sm90 128x256 gate, flags late", time_b2b(flags_late, 10), best);
    add("sm90 128x256 gate, rows late", time_b2b([&] {
          release_late(x, h_x);
          CHECK(cudaStreamSynchronize(side));
        }, 5), best);
    add("copies alone (rows + flags)", time_b2b([&] {
          for (int c = 0; c < kChunks; ++c) {
            CHECK(cudaMemcpyAsync(x + size_t(c) * chunk_rows * K, h_x + size_t(c) * chunk_rows * K,
                                  size_t(chunk_rows) * K * 2, cudaMemcpyHostToDevice, 0));
            CHECK(cudaMemcpyAsync(flags + c, &h_epochs[0], 4, cudaMemcpyHostToDevice, 0));
          }
        }, 5), best);
    set_flags(epoch);
    CHECK(cudaEventDestroy(launched));
    CHECK(cudaFreeHost(h_x));
    for (void* p : {(void*)x, (void*)w, (void*)y, (void*)ref, (void*)prompt}) CHECK(cudaFree(p));
  }
  for (auto& s : shapes) fp8_section(lt, s[0], s[1], s[2], sms);
  std::printf("\n%-32s %6s %6s %6s %10s %9s %12s\n", "variant", "M", "N", "K", "b2b ms", "TFLOP/s", "vs cuBLAS");
  for (const Row& r : table)
    std::printf("%-32s %6d %6d %6d %10.4f %9.1f %12.3f\n", r.name, r.M, r.N, r.K, r.ms,
                2.0 * r.M * r.N * r.K / r.ms / 1e9, r.ratio);
  std::printf("\n%s: %d check(s) failed\n", failures ? "FAIL" : "PASS", failures);
  return failures != 0;
}
