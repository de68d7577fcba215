// The sm90 persistent GEMM's variants (csrc/gemm/sm90, hopper_variants.h)
// alone against cuBLASLt on one Hopper GPU, before any transport feeds them.
//
//   hopper_bench [--dtype bf16|fp8] [--only PREFIX] [--tag TAG]
//
// runs the variants whose name starts with PREFIX (all by default) for one
// input dtype: bf16, or fp8 e4m3 with tensor scales (device scalars, applied
// in the epilogue; cuBLASLt fp8 with the same scales and fast accumulation is
// the reference and the baseline, its default accumulation timed beside it).
// run_sm90.sh runs one process per dtype and cluster shape, so that a variant
// that wedges the context takes only its own process down.
//
// Checks, for every variant: float64 host references on small odd shapes
// (tails in M, N and K, a cluster's second CTA past M or N, bias; bf16 and fp32
// out for bf16 in), cuBLASLt on the large and odd shapes; the output is
// poisoned with NaN before every checked launch and NaNs are counted; the
// kernel's error word (gate watchdog, bounded mbarrier waits: gemm.h) must
// stay 0, after every checked launch and every timed row; a variant that
// leaves it nonzero is dropped for the rest of the process (each of its
// launches would wait out a bound of 1 to 3 s, and its timed rows alone would
// run the process past run_sm90.sh's timeout, losing the other variants'
// rows). The chunk gate, 4 chunks of rows walked from chunk 1, per variant:
// - "gate, flags set": flags released before the launch (the fused kernels'
//   world-1 target);
// - "gate, flags late": released after the launch by 4-byte host-to-device
//   copies on another stream, in walk order;
// - "gate, rows late": x poisoned, each chunk's rows copied from pinned host
//   memory on another stream and then its flag: the result must be bitwise the
//   "flags set" one, the time is set by the copies ("copies alone" beside it).
// Times: per launch of 30 launched back to back (events between), median, after
// 5 warm-up launches; cuBLASLt's 8 best heuristic candidates are each timed the
// same way ("cublasLt best" is the fastest of them, "cublasLt first" the first
// that runs). Every timed row is also printed as a tab-separated line starting
// with ROW, which sm90_table.py joins across processes with CUTLASS's rows.
// Build and run: bash benchmarks/gemm_engine/run_sm90.sh
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "check.h"
#include "hopper_variants.h"
#include "timing.h"

using namespace sm90v;
using jo::gemm::sm90::kErrorBarrierHang;

constexpr int kChunks = 4, kOwnChunk = 1;
constexpr uint32_t kWatchdogNs = 2000000000u;
// The fp8 operands' tensor scales (x, w), passed as device scalars.
constexpr float kXScale = 0.5f, kWScale = 0.02f;
// Launch-time raster groups swept beside the default 8 for the variants in kSweep.
constexpr int kRasterSweep[] = {2, 4, 16};
static const char* const kSweep[] = {"c1 direct 256x4", "c2m tma 256x4", "c2n tma 256x4", "c2m tma 224x4"};

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
  // The first candidate that runs (a heuristic candidate can still be refused: status 15, not supported), or -1.
  int first_that_runs(const Plan& p, const void* x, const void* w, void* y) {
    for (size_t i = 0; i < p.algos.size(); ++i)
      if (try_run(p, i, x, w, y) == CUBLAS_STATUS_SUCCESS) return int(i);
    return -1;
  }
  // Each candidate that runs, timed.
  std::vector<float> time_all(const Plan& p, const void* x, const void* w, void* y) {
    std::vector<float> ms;
    for (size_t i = 0; i < p.algos.size(); ++i)
      if (try_run(p, i, x, w, y) == CUBLAS_STATUS_SUCCESS) ms.push_back(time_b2b([&] { run(p, i, x, w, y); }));
    return ms;
  }
};

static int failures = 0;
static int sms = 0;
static uint32_t* error_word = nullptr;  // the kernels' error word (device), reset after each check
static std::string tag, dtype_name;

static void verdict(const std::string& what, int M, int N, int K, Cmp c, double tol) {
  const bool ok = c.nans == 0 && c.rel_err < tol;
  failures += !ok;
  std::printf("check %-44s %6d %6d %6d  relerr %.2e  nan %.0f  %s\n", what.c_str(), M, N, K, c.rel_err, c.nans,
              ok ? "PASS" : "FAIL");
}

// Variants (key()) whose launches left the error word nonzero: not launched again.
static std::set<std::string> dropped;

template <class In, class Out>
static std::string key(const Entry<In, Out>& v) {
  return std::string(v.name) + (std::is_same_v<Out, float> ? " (fp32 out)" : "");
}

// The error word must be 0 after every checked launch and timed row (gemm.h
// says what else it can hold); returns whether it was. A variant that left it
// nonzero is dropped.
static bool check_error_word(const std::string& what, int M, int N, int K, const std::string& variant) {
  uint32_t e = 0;
  CHECK(cudaMemcpy(&e, error_word, 4, cudaMemcpyDeviceToHost));
  if (e == 0) return true;
  ++failures;
  dropped.insert(variant);
  if (e & kErrorBarrierHang)
    std::printf("check %-44s %6d %6d %6d  an mbarrier wait hung (site %u: 1 producer empty, 2 consumer full, 3 "
                "producer tail; word 0x%08x)  FAIL\n",
                what.c_str(), M, N, K, e & 3u, e);
  else
    std::printf("check %-44s %6d %6d %6d  the gate's watchdog fired on chunk %u  FAIL\n", what.c_str(), M, N, K,
                e - 1);
  std::printf("%s: dropped for the rest of this process\n", variant.c_str());
  CHECK(cudaMemset(error_word, 0, 4));
  return false;
}

template <class In, class Out>
static void launch(const Entry<In, Out>& v, const In* x, const In* w, const GemmParams<Out>& p, cudaStream_t s = 0) {
  char err[512];
  if (v.launch(x, w, p, sms, s, err, sizeof(err)) != 0) {
    std::fprintf(stderr, "%s: %s\n", v.name, err);
    std::exit(1);
  }
}

// fp8 runs with the tensor scales as device scalars; bf16 with none.
static float* dev_scales = nullptr;  // {x_scale, w_scale}

template <class In, class Out>
static GemmParams<Out> params(Out* y, int M, int N, int K, const Out* bias = nullptr) {
  GemmParams<Out> p;
  p.y = y;
  p.bias = bias;
  p.M = M, p.N = N, p.K = K;
  p.chunk_rows = M;
  p.error = error_word;
  if constexpr (std::is_same_v<In, fp8>) p.x_scale = dev_scales, p.w_scale = dev_scales + 1;
  return p;
}

template <class In, class Out>
static bool takes(const Entry<In, Out>& v, int N) {
  return v.launch != nullptr && (!v.tma_store || (size_t(N) * sizeof(Out)) % 16 == 0) && !dropped.count(key(v));
}

struct Row {
  std::string name;
  int M, N, K;
  float ms;
  double ratio;  // cuBLASLt's best time over this one
};
static std::vector<Row> table;
static void add(const std::string& name, int M, int N, int K, float ms, float base) {
  table.push_back({name, M, N, K, ms, base / ms});
  std::printf("ROW\t%s\t%s\t%d\t%d\t%d\t%s\t%.5f\n", tag.c_str(), dtype_name.c_str(), M, N, K, name.c_str(), ms);
}

// Small shapes against float64 on the host, for every variant: out is bf16
// (and fp32 where vf is given), bias, the fp8 scales.
template <class In>
static void check_host(const std::vector<Entry<In, bf16>>& vb, const std::vector<Entry<In, float>>* vf, int M, int N,
                       int K) {
  In *x, *w;
  bf16 *bias, *y;
  float *yf, *biasf;
  CHECK(cudaMalloc(&x, size_t(M) * K * sizeof(In)));
  CHECK(cudaMalloc(&w, size_t(N) * K * sizeof(In)));
  CHECK(cudaMalloc(&bias, size_t(N) * 2));
  CHECK(cudaMalloc(&y, size_t(M) * N * 2));
  CHECK(cudaMalloc(&yf, size_t(M) * N * 4));
  CHECK(cudaMalloc(&biasf, size_t(N) * 4));
  const float spread = std::is_same_v<In, fp8> ? 2.f : 1.f;
  fill_normal<<<256, 256>>>(x, size_t(M) * K, 11 + M, spread);
  fill_normal<<<256, 256>>>(w, size_t(N) * K, 12 + N, spread);
  fill_normal<<<256, 256>>>(bias, N, 13 + K, 1.f);
  std::vector<In> hx(size_t(M) * K), hw(size_t(N) * K);
  std::vector<bf16> hb(N);
  CHECK(cudaMemcpy(hx.data(), x, hx.size() * sizeof(In), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hw.data(), w, hw.size() * sizeof(In), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hb.data(), bias, hb.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> hbf(N);
  for (int n = 0; n < N; ++n) hbf[n] = __bfloat162float(hb[n]);
  CHECK(cudaMemcpy(biasf, hbf.data(), size_t(N) * 4, cudaMemcpyHostToDevice));
  const double scale = std::is_same_v<In, fp8> ? double(kXScale) * double(kWScale) : 1.0;
  std::vector<double> fx(hx.size()), fw(hw.size());
  for (size_t i = 0; i < hx.size(); ++i) fx[i] = double(static_cast<float>(hx[i]));
  for (size_t i = 0; i < hw.size(); ++i) fw[i] = double(static_cast<float>(hw[i]));
  std::vector<double> ref(size_t(M) * N);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = 0;
      for (int k = 0; k < K; ++k) s += fx[size_t(m) * K + k] * fw[size_t(n) * K + k];
      ref[size_t(m) * N + n] = scale * s + double(hbf[n]);
    }
  auto host_cmp = [&](auto* dev, const std::string& what, double tol, const std::string& variant) {
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
    check_error_word(what, M, N, K, variant);
  };
  for (const auto& v : vb) {
    if (!takes(v, N)) continue;
    CHECK(cudaMemset(y, 0xFF, size_t(M) * N * 2));
    launch(v, x, w, params<In>(y, M, N, K, bias));
    host_cmp(y, std::string("vs float64: ") + v.name + ", bf16 out", 1e-2, key(v));
  }
  if (vf != nullptr)
    for (const auto& v : *vf) {
      if (!takes(v, N)) continue;
      CHECK(cudaMemset(yf, 0xFF, size_t(M) * N * 4));
      launch(v, x, w, params<In>(yf, M, N, K, biasf));
      host_cmp(yf, std::string("vs float64: ") + v.name + ", fp32 out", 1e-4, key(v));
    }
  for (void* p : {(void*)x, (void*)w, (void*)bias, (void*)y, (void*)yf, (void*)biasf}) CHECK(cudaFree(p));
}

static bool in_sweep(const char* name) {
  for (const char* s : kSweep)
    if (std::strcmp(s, name) == 0) return true;
  return false;
}

// The large shapes: each variant against cuBLASLt, the gate, and the timings.
template <class In>
static void run_shapes(Lt& lt, const std::vector<Entry<In, bf16>>& vs) {
  constexpr bool kFp8 = std::is_same_v<In, fp8>;
  cudaStream_t side;
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  uint32_t *flags, *h_epochs;
  CHECK(cudaMalloc(&flags, kChunks * 4));
  CHECK(cudaMallocHost(&h_epochs, 4 * 1024));
  uint32_t epoch = 0;
  cudaEvent_t launched;
  CHECK(cudaEventCreateWithFlags(&launched, cudaEventDisableTiming));

  const int shapes[][3] = {{16384, 3584, 8192}, {16384, 8192, 3584}, {4096, 3584, 8192},
                           {1024, 3584, 8192},  {1000, 3576, 8192 - (kFp8 ? 16 : 8)}};
  for (auto& s : shapes) {
    const int M = s[0], N = s[1], K = s[2];
    const bool timed = M >= 1024 && M % (128 * kChunks) == 0;
    In *x, *w, *h_x = nullptr;
    bf16 *y, *ref, *prompt;
    CHECK(cudaMalloc(&x, size_t(M) * K * sizeof(In)));
    CHECK(cudaMalloc(&w, size_t(N) * K * sizeof(In)));
    CHECK(cudaMalloc(&y, size_t(M) * N * 2));
    CHECK(cudaMalloc(&ref, size_t(M) * N * 2));
    CHECK(cudaMalloc(&prompt, size_t(M) * N * 2));
    fill_normal<<<1024, 256>>>(x, size_t(M) * K, 1 + M, kFp8 ? 2.f : 1.f);
    fill_normal<<<1024, 256>>>(w, size_t(N) * K, 2 + N, kFp8 ? 2.f : 0.05f);
    auto free_all = [&] {
      for (void* p : {(void*)x, (void*)w, (void*)y, (void*)ref, (void*)prompt}) CHECK(cudaFree(p));
      if (h_x != nullptr) CHECK(cudaFreeHost(h_x));
    };
    const cudaDataType in_type = kFp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    // cuBLASLt's A is w: its scale is w's.
    auto plan = lt.plan(M, N, K, CUDA_R_16BF, nullptr, in_type, kFp8 ? dev_scales + 1 : nullptr,
                        kFp8 ? dev_scales : nullptr, true);
    const int ref_algo = lt.first_that_runs(plan, x, w, ref);
    if (ref_algo < 0) {
      std::printf("cublasLt: no candidate runs at %dx%dx%d (%s); shape skipped\n", M, N, K, dtype_name.c_str());
      free_all();
      continue;
    }
    lt.run(plan, ref_algo, x, w, ref);
    CHECK(cudaDeviceSynchronize());

    // Returns whether the error word stayed 0 (else the variant is dropped).
    auto checked = [&](const Entry<In, bf16>& v, const std::string& what, const std::function<void()>& f) {
      CHECK(cudaMemset(y, 0xFF, size_t(M) * N * 2));
      f();
      CHECK(cudaDeviceSynchronize());
      verdict(what, M, N, K, compare_dev(y, ref, size_t(M) * N), 1e-2);
      return check_error_word(what, M, N, K, key(v));
    };
    for (const auto& v : vs)
      if (takes(v, N))
        checked(v, std::string("vs cublasLt: ") + v.name, [&] { launch(v, x, w, params<In>(y, M, N, K)); });
    if (!timed) {
      free_all();
      continue;
    }

    const int chunk_rows = M / kChunks;
    auto gated = [&](uint32_t e, int group = 8) {
      GemmParams<bf16> p = params<In>(y, M, N, K);
      p.flags = flags;
      p.epoch = e;
      p.chunk_rows = chunk_rows;
      p.own_chunk = kOwnChunk;
      p.watchdog_ns = kWatchdogNs;
      p.raster_group = group;
      return p;
    };
    auto set_flags = [&](uint32_t v) {
      std::vector<uint32_t> h(kChunks, v);
      CHECK(cudaMemcpy(flags, h.data(), kChunks * 4, cudaMemcpyHostToDevice));
    };
    // Flags released after the launch, chunk by chunk in walk order, on the
    // side stream; with rows_dst, each chunk's rows copied in before its flag.
    auto release_late = [&](const Entry<In, bf16>& v, In* rows_dst, const In* rows_src) {
      const uint32_t e = ++epoch;
      h_epochs[e % 1024] = e;
      // The side stream follows what precedes the launch (the poisoning of x),
      // never the launch itself, which waits for the side stream's flags.
      CHECK(cudaEventRecord(launched, 0));
      CHECK(cudaStreamWaitEvent(side, launched));
      launch(v, x, w, gated(e));
      for (int i = 0; i < kChunks; ++i) {
        const int c = (kOwnChunk + i) % kChunks;
        if (rows_dst != nullptr)
          CHECK(cudaMemcpyAsync(rows_dst + size_t(c) * chunk_rows * K, rows_src + size_t(c) * chunk_rows * K,
                                size_t(chunk_rows) * K * sizeof(In), cudaMemcpyHostToDevice, side));
        CHECK(cudaMemcpyAsync(flags + c, &h_epochs[e % 1024], 4, cudaMemcpyHostToDevice, side));
      }
    };
    CHECK(cudaMallocHost(&h_x, size_t(M) * K * sizeof(In)));
    CHECK(cudaMemcpy(h_x, x, size_t(M) * K * sizeof(In), cudaMemcpyDeviceToHost));
    for (const auto& v : vs) {
      if (!takes(v, N)) continue;
      const std::string name = v.name;
      set_flags(++epoch);
      const uint32_t prompt_epoch = epoch;
      bool ok = checked(v, "vs cublasLt: " + name + ", gate, flags set", [&] { launch(v, x, w, gated(prompt_epoch)); });
      CHECK(cudaMemcpy(prompt, y, size_t(M) * N * 2, cudaMemcpyDeviceToDevice));
      ok = ok && checked(v, "vs cublasLt: " + name + ", gate, flags late", [&] {
             release_late(v, nullptr, nullptr);
             CHECK(cudaStreamSynchronize(side));
           });
      ok = ok && checked(v, "vs cublasLt: " + name + ", gate, rows late", [&] {
             CHECK(cudaMemset(x, 0xFF, size_t(M) * K * sizeof(In)));
             release_late(v, x, h_x);
             CHECK(cudaStreamSynchronize(side));
           });
      if (!ok) {  // dropped: x may still hold poison where the gate gave up
        CHECK(cudaMemcpy(x, h_x, size_t(M) * K * sizeof(In), cudaMemcpyHostToDevice));
        set_flags(epoch);
        continue;
      }
      const Cmp bits = compare_dev(y, prompt, size_t(M) * N);
      failures += bits.diffs != 0;
      std::printf("check %-44s %6d %6d %6d  %.0f elements differ from the flags-set launch  %s\n",
                  (name + ", gate, rows late: bitwise").c_str(), M, N, K, bits.diffs, bits.diffs == 0 ? "PASS" : "FAIL");
      set_flags(epoch);
    }

    const std::vector<float> lt_ms = lt.time_all(plan, x, w, ref);
    if (lt_ms.empty()) {
      free_all();
      continue;
    }
    const float best = *std::min_element(lt_ms.begin(), lt_ms.end());
    add(kFp8 ? "cublasLt best (fast accum)" : "cublasLt best", M, N, K, best, best);
    add(kFp8 ? "cublasLt first (fast accum)" : "cublasLt first", M, N, K, lt_ms[0], best);
    if (kFp8) {
      auto slow = lt.plan(M, N, K, CUDA_R_16BF, nullptr, in_type, dev_scales + 1, dev_scales, false);
      const std::vector<float> slow_ms = lt.time_all(slow, x, w, ref);
      if (!slow_ms.empty()) add("cublasLt best (default accum)", M, N, K, *std::min_element(slow_ms.begin(), slow_ms.end()), best);
    }
    for (const auto& v : vs) {
      // A row is kept only if its launches left the error word 0; a variant
      // that did not is dropped (takes()) and times nothing more.
      auto timed = [&](const std::string& row, const std::function<void()>& f, int reps = 30) {
        if (!takes(v, N)) return;
        const float ms = time_b2b(f, reps);
        if (check_error_word("timed: " + row, M, N, K, key(v))) add(row, M, N, K, ms, best);
      };
      if (!takes(v, N)) continue;
      const std::string name = v.name;
      timed(name, [&] { launch(v, x, w, params<In>(y, M, N, K)); });
      timed(name + " gate set", [&] { launch(v, x, w, gated(epoch)); });
      if (!in_sweep(v.name)) continue;
      for (int g : kRasterSweep) {
        GemmParams<bf16> p = params<In>(y, M, N, K);
        p.raster_group = g;
        timed(name + " g" + std::to_string(g), [&] { launch(v, x, w, p); });
      }
      timed(name + " gate late", [&] {
            release_late(v, nullptr, nullptr);
            CHECK(cudaStreamSynchronize(side));
          }, 10);
      timed(name + " gate rows late", [&] {
            release_late(v, x, h_x);
            CHECK(cudaStreamSynchronize(side));
          }, 5);
      set_flags(epoch);
    }
    add("copies alone (rows + flags)", M, N, K, time_b2b([&] {
          for (int c = 0; c < kChunks; ++c) {
            CHECK(cudaMemcpyAsync(x + size_t(c) * chunk_rows * K, h_x + size_t(c) * chunk_rows * K,
                                  size_t(chunk_rows) * K * sizeof(In), cudaMemcpyHostToDevice, 0));
            CHECK(cudaMemcpyAsync(flags + c, &h_epochs[0], 4, cudaMemcpyHostToDevice, 0));
          }
        }, 5), best);
    set_flags(epoch);
    free_all();
  }
  CHECK(cudaEventDestroy(launched));
  CHECK(cudaFreeHost(h_epochs));
  CHECK(cudaFree(flags));
  CHECK(cudaStreamDestroy(side));
}

template <class In, class Out>
static std::vector<Entry<In, Out>> select(std::vector<Entry<In, Out>> all, const char* only) {
  std::vector<Entry<In, Out>> out;
  for (const auto& v : all)
    if (std::strncmp(v.name, only, std::strlen(only)) == 0) out.push_back(v);
  return out;
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a later failure keeps the lines before it
  const char* only = "";
  dtype_name = "bf16";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--dtype")) dtype_name = argv[i + 1];
    else if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
    else if (!std::strcmp(argv[i], "--tag")) tag = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: hopper_bench [--dtype bf16|fp8] [--only PREFIX] [--tag TAG]\n");
      return 2;
    }
  }
  if (dtype_name != "bf16" && dtype_name != "fp8") {
    std::fprintf(stderr, "hopper_bench: --dtype is bf16 or fp8, got %s\n", dtype_name.c_str());
    return 2;
  }
  if (tag.empty()) tag = dtype_name + (*only ? std::string("-") + only : std::string());
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs; %s, variants \"%s*\"\n", prop.name, sms, dtype_name.c_str(), only);
  CHECK(cudaMalloc(&error_word, 4));
  CHECK(cudaMemset(error_word, 0, 4));
  CHECK(cudaMalloc(&dev_scales, 2 * sizeof(float)));
  const float h_scales[2] = {kXScale, kWScale};
  CHECK(cudaMemcpy(dev_scales, h_scales, sizeof(h_scales), cudaMemcpyHostToDevice));

  Lt lt;
  if (dtype_name == "bf16") {
    const auto vb = select(variants<bf16, bf16>(), only);
    const auto vf = select(variants<bf16, float>(), only);
    for (const auto& v : vf)
      if (v.launch == nullptr) std::printf("%s: not built for fp32 out (hopper_variants.h, entry())\n", v.name);
    // Odd N (direct epilogues only), then N a multiple of 8 with tails past the
    // tile and the cluster (TMA stores too).
    for (auto [M, N, K] : {std::array<int, 3>{200, 300, 264}, {333, 517, 1000}, {129, 257, 72}, {333, 520, 1000},
                           {129, 264, 72}, {200, 776, 264}})
      check_host(vb, &vf, M, N, K);
    run_shapes(lt, vb);
  } else {
    const auto v8 = select(variants<fp8, bf16>(), only);
    for (auto [M, N, K] : {std::array<int, 3>{333, 520, 1008}, {129, 264, 80}, {200, 776, 272}, {200, 300, 272}})
      check_host<fp8>(v8, nullptr, M, N, K);
    run_shapes(lt, v8);
  }
  std::printf("\n%-40s %6s %6s %6s %10s %9s %12s\n", "variant", "M", "N", "K", "b2b ms", "TFLOP/s", "vs cuBLASLt");
  for (const Row& r : table)
    std::printf("%-40s %6d %6d %6d %10.4f %9.1f %12.3f\n", r.name.c_str(), r.M, r.N, r.K, r.ms,
                2.0 * r.M * r.N * r.K / r.ms / 1e9, r.ratio);
  std::printf("\n%s %s: %d check(s) failed\n", tag.c_str(), failures ? "FAIL" : "PASS", failures);
  return failures != 0;
}
