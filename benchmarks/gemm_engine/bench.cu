// Tile-engine variants and the fused kernels' world-1 launches (with their
// stream-K tail scratch, as the FFI gives it) against cuBLAS on one NVIDIA
// GPU: correctness (relative error vs cuBLAS on random bf16 data; infinite
// unless a second launch repeats the bits) and time, two ways:
// - "ms": median of 20 single event-timed launches, one after the other (a
//   host sync between them);
// - "b2b ms": per launch of 20 launched back to back (as the op benchmarks'
//   chained calls run), median of 5: sustained load, at the power cap.
// (Launches timed after the GPU idled start on clocks still ramping up from
// idle, which costs cuBLAS's shorter runs more: not a fair comparison.)
// Build and run: bash benchmarks/gemm_engine/run.sh  (needs nvcc and cuBLAS).
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "check.h"
#include "gemm/gemm_tile.h"
#include "gemm/tile_scheduler.h"
#include "kernels/ag_matmul.h"
#include "kernels/matmul_rs.h"

using jo::gemm::BLayout;
using jo::gemm::TileShape;
using T = __nv_bfloat16;
// The NVIDIA mainloop of a tile shape (the variants below are NvidiaArch tiles).
template <class Shape, BLayout kL>
using Engine = jo::gemm::Mainloop<T, jo::gemm::NvidiaArch, Shape, kL>;


// kPlain runs the tiles as the fused kernels' world-1 path does
// (gemm::plain_gemm, with or without the stream-K tail); the kDrop* diagnostics (wrong results by design) read no
// global memory for A, B or both -- the copies zero-fill their shared-memory
// chunks instead -- to show what those loads cost.
enum class Mode { kPlain, kDropA, kDropB, kDropAB };

template <class Eng, Mode kMode>
__global__ __launch_bounds__(Eng::kThreads) void gemm_kernel(const T* x, const T* w, T* y, int M, int N, int K,
                                                            int group_cols, jo::gemm::TailSplit tail) {
  extern __shared__ jo::gpu::Vec16 smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  if constexpr (kMode == Mode::kPlain) {
    const jo::gemm::PlainGemm<T> g{x, w, nullptr, y, M, N, K, group_cols};
    jo::gemm::plain_gemm<Eng>(g, smem, blockIdx.x, gridDim.x, tail, [](int, uint64_t) {},
                              [](uint64_t) {});  // a stalled head adds what its slot holds: relerr shows it
    return;
  }
  constexpr bool kDropA = kMode == Mode::kDropA || kMode == Mode::kDropAB;
  constexpr bool kDropB = kMode == Mode::kDropB || kMode == Mode::kDropAB;
  const int tiles_n = (N + Eng::BN - 1) / Eng::BN;
  const int tiles_m = (M + Eng::BM - 1) / Eng::BM;
  const int64_t ldb = Eng::kBKMajor ? K : N;
  for (int t = blockIdx.x; t < tiles_m * tiles_n; t += gridDim.x) {
    const jo::gemm::TileCoord tc = jo::gemm::tile_coord(t, tiles_m, tiles_n, group_cols);
    const int m0 = tc.row * Eng::BM;
    auto a_row = [&](int r) -> const T* { return kDropA || m0 + r >= M ? nullptr : x + int64_t(m0 + r) * K; };
    const typename Eng::BSource b{w, ldb, tc.col * Eng::BN, kDropB ? 0 : N};
    auto out_row = [&](int r) { return m0 + r < M ? y + int64_t(m0 + r) * N : nullptr; };
    typename Eng::Acc acc;
    Eng::run(acc, smem, Eng::a_rows(a_row), b, K, jo::gemm::NoWait{});
    jo::gemm::StoreTile<Eng>::apply(acc, out_row, b.n0, N, static_cast<const T*>(nullptr));
  }
}

struct Timing {
  float ms;      // median single launch
  float b2b_ms;  // per launch, back to back
};

struct Result {
  Timing t;
  double rel_err;
};

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Events around `launches` back-to-back launches, per launch.
template <class F>
static float events_ms(F&& launch, int launches) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < launches; ++i) launch();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  CHECK(cudaGetLastError());
  return ms / launches;
}

template <class F>
static Timing time_ms(F&& launch, int reps) {
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> single, b2b;
  for (int i = 0; i < reps; ++i) single.push_back(events_ms(launch, 1));
  for (int i = 0; i < (reps > 1 ? 5 : 0); ++i) b2b.push_back(events_ms(launch, 20));
  return {median(single), b2b.empty() ? NAN : median(b2b)};
}

static double rel_err(const T* d_out, const T* d_ref, size_t n) {
  std::vector<T> out(n), ref(n);
  CHECK(cudaMemcpy(out.data(), d_out, n * sizeof(T), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(ref.data(), d_ref, n * sizeof(T), cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double o = __bfloat162float(out[i]), r = __bfloat162float(ref[i]);
    if (!std::isfinite(o)) return INFINITY;
    num += (o - r) * (o - r);
    den += r * r;
  }
  return std::sqrt(num / den);
}

// One launch into y poisoned with NaN (every element must be written), its
// error against ref, then its timing; relerr is infinite unless one more
// launch into poisoned y writes the same bits.
template <class F>
static Result checked_timing(F&& launch, T* y, const T* ref, size_t n, int reps) {
  CHECK(cudaMemset(y, 0xFF, n * sizeof(T)));
  launch();
  CHECK(cudaDeviceSynchronize());
  const double err = rel_err(y, ref, n);
  std::vector<T> first(n), again(n);
  CHECK(cudaMemcpy(first.data(), y, n * sizeof(T), cudaMemcpyDeviceToHost));
  const Timing t = time_ms(launch, reps);
  CHECK(cudaMemset(y, 0xFF, n * sizeof(T)));
  launch();
  CHECK(cudaMemcpy(again.data(), y, n * sizeof(T), cudaMemcpyDeviceToHost));
  return {t, std::memcmp(first.data(), again.data(), n * sizeof(T)) == 0 ? err : INFINITY};
}

// Scratch of the stream-K tail (gemm/tile_scheduler.h) for tile shape 0, one slot
// per SM as jax_overlap/planning/fused.py gives it. Filled with a byte pattern once,
// never cleared: the kernels take it as XLA hands it over, holding whatever
// an earlier user (or their own earlier launch) left.
struct TailScratchBuffer {
  void* data = nullptr;
  int slots;
  explicit TailScratchBuffer(int sms) : slots(sms) {
    CHECK(cudaMalloc(&data, jo::tail_scratch_bytes(0, slots)));
    CHECK(cudaMemset(data, 0xA5, jo::tail_scratch_bytes(0, slots)));
  }
  ~TailScratchBuffer() { cudaFree(data); }
  jo::TailScratch view() const { return {data, slots, kTailTimeoutNs}; }
  static constexpr uint64_t kTailTimeoutNs = 5'000'000'000ull;  // %globaltimer ticks
};

// Bands sized to half the L2, as the fused kernels do; tail: with the
// stream-K tail where the tiles leave a partial wave.
template <class Shape, BLayout kL, Mode kMode = Mode::kPlain>
static Result run_variant(const T* x, const T* w, T* y, const T* ref, int M, int N, int K, int sms, int reps,
                          bool tail = false) {
  using Eng = Engine<Shape, kL>;
  auto kernel = gemm_kernel<Eng, kMode>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Eng::kSmemBytes));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Eng::kThreads, Eng::kSmemBytes));
  const int tiles = (M + Eng::BM - 1) / Eng::BM * ((N + Eng::BN - 1) / Eng::BN);
  const int grid = std::min(tiles, std::max(per_sm, 1) * sms);
  int l2 = 0;
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  const int tiles_n = (N + Eng::BN - 1) / Eng::BN;
  const int cols = jo::gemm::band_columns(tiles_n, Eng::BN, K, sizeof(T), l2);
  const TailScratchBuffer scratch(sms);
  const jo::gemm::TailSplit split =
      jo::gemm::tail_split(tiles, grid, tail ? scratch.data : nullptr, scratch.slots, TailScratchBuffer::kTailTimeoutNs);
  return checked_timing(
      [&] { kernel<<<grid, Eng::kThreads, Eng::kSmemBytes>>>(x, w, y, M, N, K, cols, split); },
      y, ref, size_t(M) * N, reps);
}

// The fused kernels as the FFI launches them for a group of one: no peers,
// no trace, tile 0, w [K, N].
static jo::CallContext world1_context(int sms) {
  int l2 = 0;
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  jo::CallContext ctx{};
  ctx.peers.world = 1;
  ctx.limits = jo::LaunchLimits{sms, 1, l2};
  return ctx;
}

static jo::GemmOperands world1_operands(const T* x, const T* w, int N, int K) {
  return jo::GemmOperands{jo::DType::kBF16, 0, false, x, w, nullptr, 1, K, N, 0};
}

static Result run_fused_ag(const T* x, const T* w, T* y, const T* ref, int M, int N, int K, int sms, int reps) {
  jo::TileShapeInfo tile{};
  jo::tile_shape_info(0, &tile);
  const TailScratchBuffer scratch(sms);
  const jo::AgMatmulLaunch l{world1_operands(x, w, N, K), y, nullptr, M, tile.bk, world1_context(sms),
                             scratch.view()};
  return checked_timing([&] { CHECK(jo::launch_ag_matmul(l, nullptr)); }, y, ref, size_t(M) * N, reps);
}

static Result run_fused_rs(const T* x, const T* w, T* y, const T* ref, int M, int N, int K, int sms, int reps) {
  const TailScratchBuffer scratch(sms);
  const jo::MatmulRsLaunch l{world1_operands(x, w, N, K), y, M, world1_context(sms), scratch.view()};
  return checked_timing([&] { CHECK(jo::launch_matmul_rs(l, nullptr)); }, y, ref, size_t(M) * N, reps);
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int shapes[][3] = {
      {16384, 3584, 8192}, {16384, 8192, 3584}, {2048, 3584, 8192}, {1024, 3584, 8192}, {1000, 3576, 8184}};
  cublasHandle_t handle;
  CHECK(cublasCreate(&handle));
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::printf("%-30s %7s %7s %7s %9s %9s %9s %9s %8s\n", "variant", "M", "N", "K", "ms", "TFLOP/s", "b2b ms",
              "TFLOP/s", "relerr");
  for (auto& s : shapes) {
    if (std::getenv("JO_BENCH_ONLY") && &s != &shapes[0]) break;
    const int M = s[0], N = s[1], K = s[2];
    std::vector<T> hx(size_t(M) * K), hw(size_t(K) * N), hwt(size_t(N) * K);
    for (auto& v : hx) v = __float2bfloat16(nd(rng));
    for (auto& v : hw) v = __float2bfloat16(nd(rng) * 0.05f);
    for (int k = 0; k < K; ++k)
      for (int n = 0; n < N; ++n) hwt[size_t(n) * K + k] = hw[size_t(k) * N + n];
    T *x, *w, *wt, *y, *ref;
    CHECK(cudaMalloc(&x, hx.size() * sizeof(T)));
    CHECK(cudaMalloc(&w, hw.size() * sizeof(T)));
    CHECK(cudaMalloc(&wt, hwt.size() * sizeof(T)));
    CHECK(cudaMalloc(&y, size_t(M) * N * sizeof(T)));
    CHECK(cudaMalloc(&ref, size_t(M) * N * sizeof(T)));
    CHECK(cudaMemcpy(x, hx.data(), hx.size() * sizeof(T), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(w, hw.data(), hw.size() * sizeof(T), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(wt, hwt.data(), hwt.size() * sizeof(T), cudaMemcpyHostToDevice));
    const float one = 1.f, zero = 0.f;
    // Row-major y[M,N] = x[M,K] w[K,N] is column-major y^T = w^T x^T.
    auto cublas = [&] {
      CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, N, x, CUDA_R_16BF, K,
                         &zero, ref, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    cublas();
    CHECK(cudaDeviceSynchronize());
    const double flop = 2.0 * M * N * K;
    auto row = [&](const char* name, Result r) {
      std::printf("%-30s %7d %7d %7d %9.4f %9.1f %9.4f %9.1f %8.1e\n", name, M, N, K, r.t.ms, flop / r.t.ms / 1e9,
                  r.t.b2b_ms, flop / r.t.b2b_ms / 1e9, r.rel_err);
    };
    // JO_BENCH_ONLY=<name>: that variant once on the first shape (for ncu).
    const char* only = std::getenv("JO_BENCH_ONLY");
    const int reps = only ? 1 : 20;
    auto want = [&](const char* name) { return only == nullptr || std::strcmp(only, name) == 0; };
    if (want("cublas")) row("cublas", {time_ms(cublas, reps), 0.0});
    if (want("fused ag_matmul kernel")) row("fused ag_matmul kernel", run_fused_ag(x, w, y, ref, M, N, K, sms, reps));
    if (want("fused matmul_rs kernel")) row("fused matmul_rs kernel", run_fused_rs(x, w, y, ref, M, N, K, sms, reps));
#define VARIANT(name, BM, BN, BK, WM, WN, S, PIPE, L)                                                       \
  if (want(name))                                                                                         \
    row(name, run_variant<TileShape<BM, BN, BK, WM, WN, S, PIPE>, BLayout::L>(                             \
                  x, BLayout::L == BLayout::kKMajor ? wt : w, y, ref, M, N, K, sms, reps));
    VARIANT("128x256x64 w2x4 s3 pipe", 128, 256, 64, 2, 4, 3, true, kNMajor)
    VARIANT("128x256x64 w2x4 s4 pipe", 128, 256, 64, 2, 4, 4, true, kNMajor)
    VARIANT("128x256x64 w2x4 s3 pipe Kmaj", 128, 256, 64, 2, 4, 3, true, kKMajor)
    VARIANT("128x128x32 w2x2 s4", 128, 128, 32, 2, 2, 4, false, kNMajor)
    using Big = TileShape<128, 256, 64, 2, 4, 3, true>;
    if (want("128x256x64 s3 pipe tail split"))
      row("128x256x64 s3 pipe tail split", run_variant<Big, BLayout::kNMajor>(x, w, y, ref, M, N, K, sms, reps, true));
    auto mode_row = [&](const char* name, auto mode) {
      if (want(name))
        row(name, run_variant<Big, BLayout::kNMajor, decltype(mode)::value>(x, w, y, ref, M, N, K, sms, reps));
    };
    mode_row("diag: A not loaded", std::integral_constant<Mode, Mode::kDropA>{});
    mode_row("diag: B not loaded", std::integral_constant<Mode, Mode::kDropB>{});
    mode_row("diag: A, B not loaded", std::integral_constant<Mode, Mode::kDropAB>{});
#undef VARIANT
    CHECK(cudaFree(x));
    CHECK(cudaFree(w));
    CHECK(cudaFree(wt));
    CHECK(cudaFree(y));
    CHECK(cudaFree(ref));
  }
  CHECK(cublasDestroy(handle));
  return 0;
}
