// Ceilings of the mma.sync atom on one NVIDIA GPU, one block per SM:
// - register-fed: bf16 m16n8k16 MMAs issued back to back from registers, for
//   several warp counts and warp tiles;
// - shared-memory-fed: the tile engine's own fragment loads (ldmatrix from its
//   swizzled stage) and MMAs over one resident stage, no global memory, with
//   and without the engine's barrier per k-tile.
// The tile engine cannot beat these; its gap to them is what its global->shared
// pipeline, epilogue and scheduling cost.
// Build and run: bash benchmarks/gemm_engine/run.sh
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "check.h"
#include "gemm/mainloop.h"


using T = __nv_bfloat16;
using Atom = jo::gemm::MmaSyncAtom<T>;

// Best of 5 event-timed launches, after one warm-up launch (clocks).
template <class Launch>
static float best_ms(Launch&& launch) {
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  launch();
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaEventRecord(e0));
    launch();
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = ms < best ? ms : best;
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  return best;
}

template <int kWarps, int MI, int NI>
__global__ __launch_bounds__(kWarps * 32, 1) void mma_loop(float* out, int iters) {
  Atom::FragA a[MI];
  Atom::FragB b[NI];
  Atom::FragC c[MI][NI] = {};
  // Operands from the thread index so nothing is constant-folded.
  const uint32_t seed = threadIdx.x * 0x9E3779B9u;
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[i].r[r] = (seed + 17 * i + r) & 0x3F803F80u;
#pragma unroll
  for (int j = 0; j < NI; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) b[j].r[r] = (seed + 31 * j + r) & 0x3F803F80u;
  for (int it = 0; it < iters; ++it)
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j) Atom::mma(c[i][j], a[i], b[j]);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j) s += c[i][j].r[0] + c[i][j].r[1] + c[i][j].r[2] + c[i][j].r[3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int kWarps, int MI, int NI>
static void run(float* out, int sms) {
  const int iters = 20000;
  const float best = best_ms([&] { mma_loop<kWarps, MI, NI><<<sms, kWarps * 32>>>(out, iters); });
  const double flop = 2.0 * Atom::kM * Atom::kN * Atom::kK * MI * NI * double(iters) * kWarps * sms;
  std::printf("mma.sync ceiling  warps/SM %2d  warp tile %3dx%-3d  %7.1f TFLOP/s\n", kWarps, MI * Atom::kM,
              NI * Atom::kN, flop / best / 1e9);
}

template <class Eng, bool kBarrier>
__global__ __launch_bounds__(Eng::kThreads) void smem_fed(float* out, int k_tiles) {
  extern __shared__ jo::gpu::Vec16 smem_raw[];
  T* stage = reinterpret_cast<T*>(smem_raw);
  for (int i = threadIdx.x; i < Eng::kStageElems; i += blockDim.x) stage[i] = __float2bfloat16(float(i % 13) - 6.f);
  __syncthreads();
  typename Eng::Acc acc;
#pragma unroll
  for (int i = 0; i < Eng::MI; ++i)
#pragma unroll
    for (int j = 0; j < Eng::NI; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc.c[i][j].r[r] = 0.f;
  constexpr int kSteps = Eng::BK / Atom::kK;
  typename Eng::Frags f[2];
  const auto fo = Eng::frag_offsets();
  Eng::load_frags(f[0], stage, 0, fo);
  for (int kt = 0; kt < k_tiles; ++kt)
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      if (kBarrier && step == kSteps - 1) __syncthreads();
      Eng::load_frags(f[(step + 1) % 2], stage, (step + 1) % kSteps, fo);
      Eng::mma_frags(acc, f[step % 2]);
    }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < Eng::MI; ++i)
#pragma unroll
    for (int j = 0; j < Eng::NI; ++j) s += acc.c[i][j].r[0] + acc.c[i][j].r[3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <class Shape, bool kBarrier>
static void run_smem_fed(float* out, int sms, const char* name) {
  using Eng = jo::gemm::Mainloop<T, jo::gemm::NvidiaArch, Shape, jo::gemm::BLayout::kNMajor>;
  auto kernel = smem_fed<Eng, kBarrier>;
  const int smem = Eng::kStageElems * int(sizeof(T));
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int k_tiles = 4000;
  const int grid = sms * (256 / Eng::kThreads);  // 8 warps per SM, as the engine runs
  const float best = best_ms([&] { kernel<<<grid, Eng::kThreads, smem>>>(out, k_tiles); });
  const double flop = 2.0 * Eng::BM * Eng::BN * Eng::BK * double(k_tiles) * grid;
  std::printf("smem-fed ceiling  %-24s %s  %7.1f TFLOP/s\n", name, kBarrier ? "barrier/k-tile" : "no barrier    ",
              flop / best / 1e9);
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* out;
  CHECK(cudaMalloc(&out, size_t(sms) * 2048 * sizeof(float)));
  run<4, 4, 8>(out, sms);
  run<8, 4, 8>(out, sms);
  run<8, 2, 8>(out, sms);
  run<16, 2, 8>(out, sms);
  run<16, 2, 4>(out, sms);
  using Big = jo::gemm::TileShape<128, 256, 64, 2, 4, 3, true>;
  using Square = jo::gemm::TileShape<128, 128, 64, 2, 2, 3, true>;
  run_smem_fed<Big, false>(out, sms, "128x256x64 w2x4 pipe");
  run_smem_fed<Big, true>(out, sms, "128x256x64 w2x4 pipe");
  run_smem_fed<Square, true>(out, sms, "128x128x64 w2x2 pipe");
  CHECK(cudaFree(out));
  return 0;
}
