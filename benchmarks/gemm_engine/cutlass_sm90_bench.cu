// CUTLASS's sm90 persistent warp-specialized GEMM (cooperative, 128x256x64,
// cluster 2x1, TMA epilogue) beside the project's sm90 GEMM (its first
// variant, c1 direct 256x4) on the shapes of hopper_bench.cu: the ceiling the
// own mainloop is measured against. Same layouts (x [M,K], w [N,K], y [M,N]
// bf16), same timing (per launch of 30 back to back, median); each time also
// printed as a ROW line for sm90_table.py. Needs CUTLASS's headers (pip package
// nvidia-cutlass: cutlass_library/source/include); links only the CUDA runtime.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <vector>

#include "check.h"
#include "timing.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "gemm/sm90/gemm.h"

using namespace cute;
using bf16 = __nv_bfloat16;
using Elem = cutlass::bfloat16_t;
using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_2, _1, _1>;
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, Elem, cutlass::layout::RowMajor, 8, Elem,
    cutlass::layout::RowMajor, 8, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elem, cutlass::layout::RowMajor, 8, Elem,
    cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                    cutlass::gemm::PersistentScheduler>;
using CutlassGemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

__global__ void fill_normal(bf16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    const float u1 = (float(h >> 40) + 1.f) / 16777217.f, u2 = float(h & 0xFFFFFF) / 16777216.f;
    p[i] = __float2bfloat16(scale * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

__global__ void rel_err(const bf16* y, const bf16* ref, size_t n, double* sums) {
  double d2 = 0, r2 = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const double a = __bfloat162float(y[i]), b = __bfloat162float(ref[i]);
    d2 += a == a ? (a - b) * (a - b) : 1e300;
    r2 += b * b;
  }
  atomicAdd(&sums[0], d2);
  atomicAdd(&sums[1], r2);
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int shapes[][3] = {{16384, 3584, 8192}, {16384, 8192, 3584}, {4096, 3584, 8192}, {1024, 3584, 8192}};
  int failures = 0;
  std::printf("%-32s %6s %6s %6s %10s %9s %12s\n", "variant", "M", "N", "K", "b2b ms", "TFLOP/s", "relerr");
  for (auto& s : shapes) {
    const int M = s[0], N = s[1], K = s[2];
    bf16 *x, *w, *y, *ref;
    double* sums;
    CHECK(cudaMalloc(&x, size_t(M) * K * 2));
    CHECK(cudaMalloc(&w, size_t(N) * K * 2));
    CHECK(cudaMalloc(&y, size_t(M) * N * 2));
    CHECK(cudaMalloc(&ref, size_t(M) * N * 2));
    CHECK(cudaMalloc(&sums, 2 * sizeof(double)));
    fill_normal<<<1024, 256>>>(x, size_t(M) * K, 1 + M, 1.f);
    fill_normal<<<1024, 256>>>(w, size_t(N) * K, 2 + N, 0.05f);
    jo::gemm::sm90::GemmParams<bf16> p;
    p.y = ref;
    p.M = M, p.N = N, p.K = K;
    p.chunk_rows = M;
    char err[512];
    auto own = [&] {
      if (jo::gemm::sm90::Gemm<bf16, bf16, jo::gemm::sm90::Variant<256, 4>>::launch(x, w, p, sms, 0, err,
                                                                                  sizeof(err)) != 0) {
        std::fprintf(stderr, "%s\n", err);
        std::exit(1);
      }
    };
    own();

    using StrideA = typename CutlassGemm::GemmKernel::StrideA;
    using StrideB = typename CutlassGemm::GemmKernel::StrideB;
    using StrideC = typename CutlassGemm::GemmKernel::StrideC;
    using StrideD = typename CutlassGemm::GemmKernel::StrideD;
    const auto sa = cutlass::make_cute_packed_stride(StrideA{}, {M, K, 1});
    const auto sb = cutlass::make_cute_packed_stride(StrideB{}, {N, K, 1});
    const auto sc = cutlass::make_cute_packed_stride(StrideC{}, {M, N, 1});
    const auto sd = cutlass::make_cute_packed_stride(StrideD{}, {M, N, 1});
    auto* xe = reinterpret_cast<Elem*>(x);
    auto* we = reinterpret_cast<Elem*>(w);
    auto* ye = reinterpret_cast<Elem*>(y);
    typename CutlassGemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                         {M, N, K, 1},
                                         {xe, sa, we, sb},
                                         {{1.f, 0.f}, ye, sc, ye, sd}};
    CutlassGemm gemm;
    void* ws = nullptr;
    const size_t ws_bytes = CutlassGemm::get_workspace_size(args);
    if (ws_bytes) CHECK(cudaMalloc(&ws, ws_bytes));
    if (gemm.can_implement(args) != cutlass::Status::kSuccess ||
        gemm.initialize(args, ws) != cutlass::Status::kSuccess) {
      std::fprintf(stderr, "cutlass: cannot run %dx%dx%d\n", M, N, K);
      return 1;
    }
    auto cut = [&] { CHECK(static_cast<int>(gemm.run())); };
    CHECK(cudaMemset(y, 0xFF, size_t(M) * N * 2));
    cut();
    CHECK(cudaMemset(sums, 0, 2 * sizeof(double)));
    rel_err<<<1024, 256>>>(y, ref, size_t(M) * N, sums);
    double h[2];
    CHECK(cudaMemcpy(h, sums, sizeof(h), cudaMemcpyDeviceToHost));
    const double re = std::sqrt(h[0] / h[1]);
    failures += !(re < 1e-2);
    const double flop = 2.0 * M * N * K;
    const float t_cut = time_b2b(cut), t_own = time_b2b(own);
    std::printf("%-32s %6d %6d %6d %10.4f %9.1f %12.2e\n", "cutlass 128x256 coop c2x1", M, N, K, t_cut,
                flop / t_cut / 1e9, re);
    std::printf("%-32s %6d %6d %6d %10.4f %9.1f %12s\n", "sm90 c1 direct 256x4", M, N, K, t_own, flop / t_own / 1e9,
                "(ref)");
    std::printf("ROW\tcutlass\tbf16\t%d\t%d\t%d\tcutlass 128x256 coop c2x1\t%.5f\n", M, N, K, t_cut);
    std::printf("ROW\tcutlass\tbf16\t%d\t%d\t%d\tc1 direct 256x4 (in the CUTLASS process)\t%.5f\n", M, N, K, t_own);
    if (ws) CHECK(cudaFree(ws));
    for (void* q : {(void*)x, (void*)w, (void*)y, (void*)ref, (void*)sums}) CHECK(cudaFree(q));
  }
  std::printf("%s: %d check(s) failed\n", failures ? "FAIL" : "PASS", failures);
  return failures != 0;
}
