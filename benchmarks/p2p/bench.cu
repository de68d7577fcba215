// Peer-to-peer microbenchmark between GPU 0 and GPU 1 (same host): what the
// fused kernels' cross-GPU moves cost. Pull = GPU 0 loads GPU 1's memory
// (gpu::load16_uncached, as copy_chunk does); push = GPU 0 stores into GPU 1's
// memory; pull with pollers = a pull while the other workgroups poll a flag as
// the fused kernels' waiting GEMM workgroups do; flag = round trip of a
// release/acquire ping-pong between the GPUs; fence = a system-scope release
// store after a chunk of local writes. NVIDIA only
// (CUDA runtime API on the host; the device side is csrc/platform/gpu.h).
//   bash benchmarks/p2p/run.sh
#include <cstdio>
#include <type_traits>
#include <vector>

#include "platform/gpu.h"

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

namespace gpu = jo::gpu;
using gpu::Vec16;

template <int U, bool kPush>
__global__ void copy_kernel(const char* src, char* dst, size_t bytes) {
  const size_t vecs = bytes / 16;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t v0 = size_t(blockIdx.x) * blockDim.x + threadIdx.x; v0 < vecs; v0 += stride * U) {
    Vec16 val[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t v = v0 + u * stride;
      if (v < vecs) val[u] = kPush ? gpu::load16(src + v * 16) : gpu::load16_uncached(src + v * 16);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t v = v0 + u * stride;
      if (v < vecs) gpu::store16(dst + v * 16, val[u]);
    }
  }
}

// Thread 0 of GPU `me` waits for `in` to reach i, then releases `out` = i + 1.
__global__ void pingpong(uint32_t* in, uint32_t* out, int iters, int me) {
  if (threadIdx.x != 0) return;
  for (int i = 0; i < iters; ++i) {
    const uint32_t want = 2 * i + me;
    while (gpu::load_acquire_sys(in) < want) {
    }
    gpu::store_release_sys(out, want + 1);
  }
}

// One block writes `bytes` locally then releases a flag, `iters` times.
template <bool kSys>
__global__ void write_release(char* buf, size_t bytes, uint32_t* flag, int iters) {
  for (int i = 0; i < iters; ++i) {
    for (size_t v = threadIdx.x; v < bytes / 16; v += blockDim.x) gpu::store16(buf + v * 16, Vec16{});
    __syncthreads();
    if (threadIdx.x == 0) {
      if (kSys) gpu::store_release_sys(flag, i); else gpu::store_release_dev(flag, i);
    }
    __syncthreads();
  }
}

// Blocks [0, pullers) pull `bytes` from the peer as copy_kernel does (unroll 8),
// then count themselves done; the other blocks act as the fused kernels' GEMM
// workgroups waiting on a flag: thread 0 polls `flag` (never set) with an
// acquire load and back-off, reading the host-mapped `host_word` every 64 polls
// when kHostReads (the watchdog), until every puller is done.
enum class Poll { kNone, kDevice, kDeviceHost, kSystem };

template <Poll kPoll>
__global__ void pull_with_pollers(const char* src, char* dst, size_t bytes, int pullers, uint32_t* done,
                                  const uint32_t* flag, const volatile uint32_t* host_word) {
  constexpr int U = 8;
  if (static_cast<int>(blockIdx.x) < pullers) {
    const size_t vecs = bytes / 16;
    const size_t stride = size_t(pullers) * blockDim.x;
    for (size_t v0 = size_t(blockIdx.x) * blockDim.x + threadIdx.x; v0 < vecs; v0 += stride * U) {
      Vec16 val[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (v0 + u * stride < vecs) val[u] = gpu::load16_uncached(src + (v0 + u * stride) * 16);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (v0 + u * stride < vecs) gpu::store16(dst + (v0 + u * stride) * 16, val[u]);
    }
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(done, 1u);
    return;
  }
  if (kPoll == Poll::kNone || threadIdx.x != 0) return;
  uint32_t sink = 0;
  for (uint32_t it = 1; gpu::load_acquire_dev(done) < static_cast<uint32_t>(pullers); ++it) {
    sink += kPoll == Poll::kSystem ? gpu::load_acquire_sys(flag) : gpu::load_acquire_dev(flag);
    gpu::backoff();
    if (kPoll == Poll::kDeviceHost && (it & 63) == 0) sink += *host_word;
  }
  if (sink == 0xffffffffu) *const_cast<uint32_t*>(flag) = sink;  // keeps the polls
}

template <class F>
float time_ms(F f, int reps = 5) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  f();
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) f();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms / reps;
}

int main() {
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  if (n < 2) { std::printf("needs 2 GPUs\n"); return 1; }
  int can = 0;
  CHECK(cudaDeviceCanAccessPeer(&can, 0, 1));
  std::printf("can access peer 0->1: %d\n", can);
  const size_t bytes = 256u << 20;
  char *a0, *b0, *a1;
  uint32_t *f0, *f1;
  CHECK(cudaSetDevice(1));
  CHECK(cudaMalloc(&a1, bytes));
  CHECK(cudaMalloc(&f1, 256));
  CHECK(cudaMemset(f1, 0, 256));
  CHECK(cudaDeviceEnablePeerAccess(0, 0));
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&a0, bytes));
  CHECK(cudaMalloc(&b0, bytes));
  CHECK(cudaMalloc(&f0, 256));
  CHECK(cudaMemset(f0, 0, 256));
  CHECK(cudaDeviceEnablePeerAccess(1, 0));
  CHECK(cudaMemset(a0, 1, bytes));
  CHECK(cudaDeviceSynchronize());

  auto gbps = [&](float ms) { return bytes / (ms * 1e-3) / 1e9; };
  std::printf("%-34s %8s\n", "move (256 MiB, 256 threads/block)", "GB/s");
  for (int blocks : {2, 8, 32, 132}) {
    std::printf("pull  %3d blocks unroll 4  %8.1f\n", blocks,
                gbps(time_ms([&] { copy_kernel<4, false><<<blocks, 256>>>(a1, b0, bytes); })));
    std::printf("pull  %3d blocks unroll 16 %8.1f\n", blocks,
                gbps(time_ms([&] { copy_kernel<16, false><<<blocks, 256>>>(a1, b0, bytes); })));
    std::printf("push  %3d blocks unroll 4  %8.1f\n", blocks,
                gbps(time_ms([&] { copy_kernel<4, true><<<blocks, 256>>>(a0, a1, bytes); })));
    std::printf("local %3d blocks unroll 4  %8.1f\n", blocks,
                gbps(time_ms([&] { copy_kernel<4, false><<<blocks, 256>>>(a0, b0, bytes); })));
  }
  std::printf("memcpy peer 1->0            %8.1f\n",
              gbps(time_ms([&] { CHECK(cudaMemcpyPeerAsync(b0, 0, a1, 1, bytes, nullptr)); })));

  // Pulls while the rest of the GPU polls a flag, as the fused kernels' waiting GEMM workgroups do.
  {
    uint32_t* done = f0 + 16;
    uint32_t* host = nullptr;
    CHECK(cudaHostAlloc(&host, 64, cudaHostAllocMapped));
    *host = 0;
    const size_t pb = 64u << 20;
    for (int pullers : {6, 23}) {
      auto run = [&](auto poll) {
        return time_ms([&] {
          CHECK(cudaMemsetAsync(done, 0, 4));
          pull_with_pollers<decltype(poll)::value><<<132, 256>>>(a1, b0, pb, pullers, done, f0 + 32, host);
        });
      };
      const float none = run(std::integral_constant<Poll, Poll::kNone>{});
      const float dev = run(std::integral_constant<Poll, Poll::kDevice>{});
      const float host_reads = run(std::integral_constant<Poll, Poll::kDeviceHost>{});
      const float sys = run(std::integral_constant<Poll, Poll::kSystem>{});
      auto g = [&](float ms) { return pb / (ms * 1e-3) / 1e9; };
      std::printf("pull 64 MiB by %2d blocks, other blocks: exit %.1f, poll gpu-scope %.1f, + host reads %.1f, "
                  "poll sys-scope %.1f GB/s\n", pullers, g(none), g(dev), g(host_reads), g(sys));
    }
  }

  // Ping-pong: GPU 0's flag lives on GPU 1 and vice versa (each polls its own memory).
  const int iters = 2000;
  cudaStream_t s1;
  CHECK(cudaSetDevice(1));
  CHECK(cudaStreamCreate(&s1));
  CHECK(cudaMemset(f1, 0, 256));
  CHECK(cudaSetDevice(0));
  CHECK(cudaMemset(f0, 0, 256));
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventRecord(e0));
  pingpong<<<1, 32>>>(f0, f1, iters, 0);  // GPU 0 waits on f0 (written by GPU 1), writes f1
  CHECK(cudaSetDevice(1));
  pingpong<<<1, 32, 0, s1>>>(f1, f0, iters, 1);
  CHECK(cudaSetDevice(0));
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  std::printf("flag round trip (release.sys -> acquire.sys, poll own memory): %.2f us\n", ms * 1e3 / iters);

  for (size_t chunk : {size_t(64) << 10, size_t(512) << 10}) {
    const int n_it = 200;
    const float dev = time_ms([&] { write_release<false><<<1, 256>>>(b0, chunk, f0, n_it); }, 2);
    const float sys = time_ms([&] { write_release<true><<<1, 256>>>(b0, chunk, f0, n_it); }, 2);
    const float remote = time_ms([&] { write_release<true><<<1, 256>>>(b0, chunk, f1, n_it); }, 2);
    std::printf("%4zu KiB write + release: gpu scope %.2f us, sys scope %.2f us, sys to peer flag %.2f us\n",
                chunk >> 10, dev * 1e3 / n_it, sys * 1e3 / n_it, remote * 1e3 / n_it);
  }
  return 0;
}
