// Hopper PTX the sm90 GEMM is built from: mbarriers (bounded waits), thread
// block clusters, TMA tile loads (multicast too) and stores, wgmma descriptors
// and fences, setmaxnreg, and the system-scope flag load that gates a tile on
// its chunk. wgmma and setmaxnreg need the sm_90a target
// (-gencode=arch=compute_90a,code=sm_90a); elsewhere they trap.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace jo::gemm::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// Makes the initialized barriers visible to the TMA unit before its first
// completion lands on one.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The producer's arrival: announces the bytes the TMA loads will complete.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// The error word's barrier bit: a wait on an mbarrier that outlasted its
// bound. The low bits say which wait (HangSite); 1 + chunk below it is the
// chunk gate's watchdog.
constexpr uint32_t kErrorBarrierHang = 0x80000000u;
enum HangSite : uint32_t { kHangProducerEmpty = 1, kHangConsumerFull = 2, kHangProducerTail = 3 };

// Waits for the phase of the given parity to complete. A fresh barrier counts
// its phase before the first as complete, so waiting on parity 1 passes at once:
// the producer's first pass over the ring finds every slot empty.
//
// Bounded: a wait that lasts hang_ns (a protocol bug, such as a cluster peer's
// arrival that never comes) records kErrorBarrierHang | site in *error and
// returns; once the word holds that bit every later slow wait returns at once,
// so the grid drains (its output garbage) instead of hanging, and the host
// reads the word. Without an error word it traps. The clock is read only
// after a first failed try.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity, uint32_t* error, uint64_t hang_ns,
                                          uint32_t site) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t start = globaltimer_ns();
  while (!mbar_try_wait(bar, parity)) {
    if (error != nullptr && (*reinterpret_cast<volatile uint32_t*>(error) & kErrorBarrierHang)) return;
    if (globaltimer_ns() - start > hang_ns) {
      if (error == nullptr) __trap();
      atomicOr(error, kErrorBarrierHang | site);
      return;
    }
  }
}

// Thread block clusters (sm_90). The CTA's rank in its cluster, the cluster-wide
// barrier every thread of every CTA of the cluster passes (release / acquire:
// barriers initialized before it are visible to the peers after it), and an
// arrival on the mbarrier at the same offset in the shared memory of CTA
// `cta` of the cluster (the own CTA included). The arrival has the default
// semantics (release at CTA scope), as CUTLASS's cluster barriers do: what it
// publishes is that wgmma (async proxy) reads of a slot are complete, which
// wgmma.wait_group already ordered; `.release.cluster` compiled to a
// MEMBAR.ALL.GPU before every arrival.
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(smem_addr(bar)),
      "r"(cta)
      : "memory");
}

// A barrier among the `threads` threads (a multiple of 32) that name `id`
// (1 to 15; 0 is __syncthreads').
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Counts this thread toward the barrier without waiting for it.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// One 2-D box of a tensor map into shared memory, completing on `bar`.
// c0 is the inner (contiguous) coordinate.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// The same box written at the same shared-memory offset in every CTA of the
// cluster named in `ctas` (bit i: rank i), each copy completing its bytes on
// the mbarrier at `bar`'s offset in that CTA.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                                      uint16_t ctas) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(ctas)
      : "memory");
}

// A box of shared memory to global memory through the tensor map (elements
// outside the tensor are not written), tracked as part of this thread's open
// bulk group. Ordinary stores that wrote the box need fence_proxy_async_shared
// in each writing thread, then a barrier, before it.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map),
               "r"(smem_addr(src)), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Until at most kPending of this thread's bulk groups have not finished
// reading their shared memory (the buffers of the others may be rewritten).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Until every bulk group of this thread has completed, its global writes included.
__device__ __forceinline__ void bulk_wait_group_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// Shared-memory descriptor of a K-major tile stored with the 128-byte swizzle
// TMA writes (rows of 128 bytes, 8-row atoms of 1024 bytes, the tile 1024-byte
// aligned): stride between atoms 1024 bytes, leading offset unused for this
// layout. Adding 2 (32 bytes >> 4) steps one k16 (bf16) or k32 (fp8) slice.
__device__ __forceinline__ uint64_t smem_desc_k128b(const void* tile) {
  return (uint64_t(smem_addr(tile) >> 4) & 0x3FFF) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
#endif
}

// setmaxnreg moves registers between warpgroups; every warp of a warpgroup
// executes the same one, and the kernel needs a register cap at entry
// (__launch_bounds__(threads, 1)).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}

// A chunk's flag is written by a copy engine (memcpy or memset) after the
// chunk's data: the acquire orders this thread's later reads after the data,
// and the proxy fence extends that to the TMA (async proxy) loads it issues.
__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace jo::gemm::sm90
