// NVIDIA's asynchronous global -> shared copies (sm_80+): cp.async through L2
// only, zero-filled when !valid, tracked in commit groups. The copy mode of
// NvidiaArch (gemm/copy.h has the interface); included by gemm/arch_traits.h
// in CUDA builds.
#pragma once

#include <cstdint>

namespace jo::gemm {

struct CpAsyncCopy {
  static __device__ __forceinline__ void copy16(void* smem, const void* gmem, bool valid) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
  }
  static __device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
  template <int kPending>
  static __device__ __forceinline__ void wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
  }
};

}  // namespace jo::gemm
