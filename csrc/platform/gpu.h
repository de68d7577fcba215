// The one portability header: the only file that knows whether it is built as
// HIP for AMD (gfx942 / gfx950) or as CUDA for NVIDIA (sm_90). Sources use HIP
// names (hipStream_t, hipMalloc, ...); on NVIDIA they map to CUDA here. Device
// code gets the few vendor-specific pieces it needs through jo::gpu: memory-
// ordered flag accesses at device or system scope, a wall-clock timer, 16-byte
// moves and the 16-bit float types. The GEMM's vendor pieces (MMA atoms,
// asynchronous copies) are gemm/arch_traits.h's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#if defined(JAX_OVERLAP_HIP) || defined(__HIP__) || defined(__HIPCC__)
#define JO_PLATFORM_HIP 1
#include <hip/hip_runtime.h>
#elif defined(JAX_OVERLAP_CUDA) || defined(__CUDACC__)
#define JO_PLATFORM_CUDA 1
#include <cuda.h>  // driver types of the entry points resolved at run time
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#else
#error "jax_overlap: build with JAX_OVERLAP_HIP (AMD) or JAX_OVERLAP_CUDA (NVIDIA)"
#endif

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
#define JO_DEVICE __device__ __forceinline__
#define JO_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JO_DEVICE inline
#define JO_HOST_DEVICE inline
#endif

// ---------------------------------------------------------------------------
// Host runtime API: HIP names, mapped to CUDA on NVIDIA.
// ---------------------------------------------------------------------------
#if JO_PLATFORM_CUDA
using hipError_t = cudaError_t;
using hipStream_t = cudaStream_t;
using hipIpcMemHandle_t = cudaIpcMemHandle_t;
using hipDeviceProp_t = cudaDeviceProp;
#define hipSuccess cudaSuccess
#define hipErrorInvalidValue cudaErrorInvalidValue
#define hipErrorPeerAccessAlreadyEnabled cudaErrorPeerAccessAlreadyEnabled
#define hipErrorNotReady cudaErrorNotReady
#define hipGetErrorString cudaGetErrorString
#define hipGetLastError cudaGetLastError
#define hipGetDevice cudaGetDevice
#define hipSetDevice cudaSetDevice
#define hipGetDeviceProperties cudaGetDeviceProperties
#define hipDriverGetVersion cudaDriverGetVersion
#define hipDeviceGetAttribute cudaDeviceGetAttribute
#define hipDeviceGetPCIBusId cudaDeviceGetPCIBusId
#define hipDeviceCanAccessPeer cudaDeviceCanAccessPeer
#define hipDeviceEnablePeerAccess cudaDeviceEnablePeerAccess
#define hipMalloc cudaMalloc
#define hipFree cudaFree
#define hipHostMalloc(ptr, size, flags) cudaHostAlloc(ptr, size, flags)
#define hipHostFree cudaFreeHost
#define hipHostGetDevicePointer cudaHostGetDevicePointer
#define hipHostMallocMapped cudaHostAllocMapped
#define hipMemset cudaMemset
#define hipMemsetAsync cudaMemsetAsync
#define hipMemcpy cudaMemcpy
#define hipMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define hipMemcpyHostToDevice cudaMemcpyHostToDevice
#define hipStreamCreateWithFlags cudaStreamCreateWithFlags
#define hipStreamNonBlocking cudaStreamNonBlocking
#define hipStreamDestroy cudaStreamDestroy
#define hipStreamSynchronize cudaStreamSynchronize
#define hipDeviceSynchronize cudaDeviceSynchronize
#define hipIpcGetMemHandle cudaIpcGetMemHandle
#define hipIpcOpenMemHandle cudaIpcOpenMemHandle
#define hipIpcCloseMemHandle cudaIpcCloseMemHandle
#define hipIpcMemLazyEnablePeerAccess cudaIpcMemLazyEnablePeerAccess
#define hipFuncSetAttribute(fn, attr, value) cudaFuncSetAttribute(fn, attr, value)
#define hipFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define hipOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define hipDeviceAttributeMultiprocessorCount cudaDevAttrMultiProcessorCount
#define hipDeviceAttributeSharedMemPerBlockOptin cudaDevAttrMaxSharedMemoryPerBlockOptin
#define hipDeviceAttributeL2CacheSize cudaDevAttrL2CacheSize
using hipEvent_t = cudaEvent_t;
#define hipMemcpyAsync cudaMemcpyAsync
#define hipMemcpy2DAsync cudaMemcpy2DAsync
#define hipMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define hipStreamCreateWithPriority cudaStreamCreateWithPriority
#define hipDeviceGetStreamPriorityRange cudaDeviceGetStreamPriorityRange
#define hipStreamWaitEvent cudaStreamWaitEvent
#define hipEventCreate cudaEventCreate
#define hipEventCreateWithFlags cudaEventCreateWithFlags
#define hipEventDisableTiming cudaEventDisableTiming
#define hipEventRecord cudaEventRecord
#define hipEventSynchronize cudaEventSynchronize
#define hipEventQuery cudaEventQuery
#define hipEventElapsedTime cudaEventElapsedTime
#define hipEventDestroy cudaEventDestroy
using hipGraph_t = cudaGraph_t;
using hipGraphExec_t = cudaGraphExec_t;
#define hipStreamBeginCapture cudaStreamBeginCapture
#define hipStreamEndCapture cudaStreamEndCapture
#define hipStreamCaptureModeThreadLocal cudaStreamCaptureModeThreadLocal
#define hipStreamIsCapturing cudaStreamIsCapturing
using hipStreamCaptureStatus = cudaStreamCaptureStatus;
#define hipStreamCaptureStatusActive cudaStreamCaptureStatusActive
#define hipGraphInstantiateWithFlags cudaGraphInstantiateWithFlags
#define hipGraphLaunch cudaGraphLaunch
#define hipGraphDestroy cudaGraphDestroy
#define hipGraphExecDestroy cudaGraphExecDestroy
#endif

namespace jo::gpu {

#if JO_PLATFORM_HIP
inline constexpr const char* kPlatformName = "rocm";
inline constexpr int kWarpSize = 64;
using bf16 = __bf16;
using fp16 = _Float16;
#else
inline constexpr const char* kPlatformName = "cuda";
inline constexpr int kWarpSize = 32;
using bf16 = __nv_bfloat16;
using fp16 = __half;
#endif

// The device's architecture as compilers name it: "sm_90", "gfx942", ...
inline std::string arch_name(const hipDeviceProp_t& prop) {
#if JO_PLATFORM_HIP
  std::string arch = prop.gcnArchName;
  return arch.substr(0, arch.find(':'));  // drop feature suffixes such as ":sramecc+:xnack-"
#else
  return "sm_" + std::to_string(prop.major) + std::to_string(prop.minor);
#endif
}

// timer_ticks() per microsecond as device code may assume it (thresholds that
// need not be exact, such as which waits are worth a trace event): NVIDIA's
// %globaltimer counts nanoseconds, gfx9's s_memrealtime runs at 100 MHz.
#if JO_PLATFORM_HIP
inline constexpr uint64_t kNominalTicksPerMicrosecond = 100;
#else
inline constexpr uint64_t kNominalTicksPerMicrosecond = 1000;
#endif

// Ticks per second of timer_ticks(), as the device reports it; the host
// converts the watchdog timeout and trace timestamps with it.
inline int64_t timer_ticks_per_second(int device) {
#if JO_PLATFORM_HIP
  int khz = 100000;  // s_memrealtime runs at a constant 100 MHz on gfx9
#if HIP_VERSION >= 50700000  // the attribute is missing from older headers
  if (hipDeviceGetAttribute(&khz, hipDeviceAttributeWallClockRate, device) != hipSuccess || khz <= 0)
    khz = 100000;
#else
  (void)device;
#endif
  return int64_t{khz} * 1000;
#else
  (void)device;
  return 1000000000;  // %globaltimer counts nanoseconds.
#endif
}

// The copy kinds of the pipelined algorithm's transfers (pipelined/copy.h
// tries its paths in this order at initialize() and keeps the first whose
// bytes land from every peer). The copy engine: on AMD an SDMA engine, never a
// copy kernel on the compute units (hipMemcpyDeviceToDeviceNoCU, ROCm >= 6.2;
// older headers, such as the ROCm 5 ones CI compiles against, lack it); on
// NVIDIA device-to-device copies, which its copy engines move between devices
// and IPC mappings by themselves. Then the plain device-to-device copy: on AMD
// ROCr may run it as a blit kernel on the CUs (ROCm/rocm-systems #11450); on
// NVIDIA it is the same kind as the first, tried again so that the fallback
// code is the same on both vendors (and runs on NVIDIA under fault injection).
#if JO_PLATFORM_HIP && HIP_VERSION >= 60200000
inline constexpr hipMemcpyKind kEngineCopyKind = hipMemcpyDeviceToDeviceNoCU;
inline constexpr const char* kEngineCopyKindName = "hipMemcpyDeviceToDeviceNoCU";
#elif JO_PLATFORM_HIP
inline constexpr hipMemcpyKind kEngineCopyKind = hipMemcpyDeviceToDevice;
inline constexpr const char* kEngineCopyKindName = "hipMemcpyDeviceToDevice";
#else
inline constexpr cudaMemcpyKind kEngineCopyKind = cudaMemcpyDeviceToDevice;
inline constexpr const char* kEngineCopyKindName = "cudaMemcpyDeviceToDevice";
#endif
#if JO_PLATFORM_HIP
inline constexpr hipMemcpyKind kPlainCopyKind = hipMemcpyDeviceToDevice;
inline constexpr const char* kPlainCopyKindName = "hipMemcpyDeviceToDevice";
#else
inline constexpr cudaMemcpyKind kPlainCopyKind = cudaMemcpyDeviceToDevice;
inline constexpr const char* kPlainCopyKindName = "cudaMemcpyDeviceToDevice";
#endif

// Memory that peer GPUs read and write while this GPU's kernels run (the
// symmetric workspace). On AMD, hipMalloc memory is coarse-grained: coherent
// between GPUs only at kernel boundaries, so a flag a peer releases mid-kernel
// may never be seen; uncached device memory (what RCCL, iris and mori use for
// peer-visible buffers; hipDeviceMallocUncached, 0x3, missing from older
// headers) is coherent while kernels run, and IPC-exportable. Unverified on
// AMD hardware. NVIDIA's device memory is coherent for peers' system-scope
// accesses already.
#if JO_PLATFORM_HIP
inline hipError_t malloc_peer_coherent(void** ptr, size_t bytes) {
  return hipExtMallocWithFlags(ptr, bytes, /*hipDeviceMallocUncached=*/0x3);
}
#else
inline hipError_t malloc_peer_coherent(void** ptr, size_t bytes) { return cudaMalloc(ptr, bytes); }
#endif

// Enqueues a 32-bit store of `value` to device memory (this GPU's or a peer's)
// on `stream`, ordered after the stream's earlier work and preceded by a
// memory fence: the signal of the pipelined algorithm. NVIDIA's
// cuStreamWriteValue32 is a driver entry point, resolved at run time so that
// the build links no driver library.
#if JO_PLATFORM_HIP
inline hipError_t stream_write_u32(hipStream_t stream, uint32_t* address, uint32_t value) {
  return hipStreamWriteValue32(stream, address, value, 0);
}
#else
inline hipError_t stream_write_u32(hipStream_t stream, uint32_t* address, uint32_t value) {
  using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  static const WriteValue32 write = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const bool ok = cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault,
                                                     &found) == cudaSuccess &&
                    found == cudaDriverEntryPointSuccess;
    return ok ? reinterpret_cast<WriteValue32>(fn) : nullptr;
  }();
  if (write == nullptr) return cudaErrorNotSupported;
  // Driver and runtime error codes coincide for the errors this can return.
  return static_cast<cudaError_t>(
      write(stream, reinterpret_cast<CUdeviceptr>(address), value, CU_STREAM_WRITE_VALUE_DEFAULT));
}
#endif

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)

// ---------------------------------------------------------------------------
// Flags. Protocol rule: a flag written on one GPU and read on another is
// released and acquired at system scope; a flag read only on the GPU that
// wrote it uses device (agent) scope. Values are epochs, so flags are never
// reset between calls.
// ---------------------------------------------------------------------------
#if JO_PLATFORM_HIP
JO_DEVICE uint32_t load_acquire_sys(const uint32_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
JO_DEVICE uint32_t load_acquire_dev(const uint32_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
JO_DEVICE void store_release_sys(uint32_t* p, uint32_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
JO_DEVICE void store_release_dev(uint32_t* p, uint32_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
JO_DEVICE uint64_t load_acquire_dev(const uint64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
JO_DEVICE void store_release_dev(uint64_t* p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
JO_DEVICE uint32_t atomic_cas_sys(uint32_t* p, uint32_t expected, uint32_t desired) {
  __hip_atomic_compare_exchange_strong(p, &expected, desired, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE,
                                       __HIP_MEMORY_SCOPE_SYSTEM);
  return expected;
}
JO_DEVICE uint32_t atomic_add_dev(uint32_t* p, uint32_t v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
JO_DEVICE uint32_t atomic_max_dev(uint32_t* p, uint32_t v) {
  return __hip_atomic_fetch_max(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
// The max of v over the calling wavefront's lanes (all of them active): six shuffles (ds_bpermute on gfx942).
JO_DEVICE uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const uint32_t other = __shfl_xor(v, offset);
    v = other > v ? other : v;
  }
  return v;
}
// a / b as XLA's GPU code divides float32: XLA sets no division precision for AMDGPU, so a plain fdiv, which
// LLVM's AMDGPU backend rounds correctly (the bit-for-bit test against XLA's form has run on NVIDIA only).
JO_DEVICE float div_as_xla(float a, float b) { return a / b; }
JO_DEVICE uint64_t timer_ticks() { return __builtin_amdgcn_s_memrealtime(); }
JO_DEVICE void backoff() { __builtin_amdgcn_s_sleep(2); }
JO_DEVICE void trap() { __builtin_trap(); }
#else
JO_DEVICE uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
JO_DEVICE uint32_t load_acquire_dev(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
JO_DEVICE void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
JO_DEVICE void store_release_dev(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
JO_DEVICE uint64_t load_acquire_dev(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
JO_DEVICE void store_release_dev(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
JO_DEVICE uint32_t atomic_cas_sys(uint32_t* p, uint32_t expected, uint32_t desired) {
  return atomicCAS_system(p, expected, desired);
}
JO_DEVICE uint32_t atomic_add_dev(uint32_t* p, uint32_t v) { return atomicAdd(p, v); }
JO_DEVICE uint32_t atomic_max_dev(uint32_t* p, uint32_t v) { return atomicMax(p, v); }
// The max of v over the calling warp's lanes (all of them active): one redux.sync (sm_80+).
JO_DEVICE uint32_t warp_max(uint32_t v) { return __reduce_max_sync(0xffffffffu, v); }
// a / b as XLA's GPU code divides float32: div.full.f32 (XLA compiles with -nvptx-prec-divf32=1; within 2 ulp,
// not always the correctly rounded quotient), so that a value computed here equals XLA's form bit for bit.
JO_DEVICE float div_as_xla(float a, float b) {
  float q;
  asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
  return q;
}
JO_DEVICE uint64_t timer_ticks() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
JO_DEVICE void backoff() { __nanosleep(64); }
JO_DEVICE void trap() { __trap(); }
#endif

// The max of v over a workgroup of kThreads threads (every one calls it), valid in thread 0 only: each warp's max
// in one warp-wide step, then the warps' maxes by thread 0 after a single barrier (a tree of shared-memory steps
// takes a barrier each). At most once per kernel: a second call would write the same shared array while thread 0
// may still read it.
template <int kThreads>
JO_DEVICE uint32_t workgroup_max(uint32_t v) {
  static_assert(kThreads % kWarpSize == 0, "workgroup_max: whole warps");
  constexpr int kWarps = kThreads / kWarpSize;
  __shared__ uint32_t partial[kWarps];
  v = warp_max(v);
  if (threadIdx.x % kWarpSize == 0) partial[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 1; i < kWarps; ++i) v = partial[i] > v ? partial[i] : v;
  }
  return v;
}

// ---------------------------------------------------------------------------
// 16-byte moves. Data that another GPU wrote is read past the non-coherent
// caches (L1 on NVIDIA; the acquire above already invalidated L2 on AMD).
// ---------------------------------------------------------------------------
struct alignas(16) Vec16 {
  uint32_t w[4];
};

#if JO_PLATFORM_HIP
JO_DEVICE Vec16 load16_uncached(const void* p) {
  Vec16 v;
  const uint32_t* q = static_cast<const uint32_t*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) v.w[i] = __builtin_nontemporal_load(q + i);
  return v;
}
#else
JO_DEVICE Vec16 load16_uncached(const void* p) {
  Vec16 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p));
  return v;
}
#endif
JO_DEVICE Vec16 load16(const void* p) { return *static_cast<const Vec16*>(p); }
JO_DEVICE void store16(void* p, const Vec16& v) { *static_cast<Vec16*>(p) = v; }

// Whether `v` holds in every thread of the workgroup (a barrier). HIP's
// __syncthreads_and needs device-library symbols (the wavefront size) that
// the compile check does not link: the same through shared memory there.
#if JO_PLATFORM_HIP
JO_DEVICE bool block_all(bool v) {
  __shared__ int any_false;
  if (threadIdx.x == 0) any_false = 0;
  __syncthreads();
  if (!v) any_false = 1;  // every writer stores the same value
  __syncthreads();
  const bool all = any_false == 0;
  __syncthreads();  // any_false is reused by the next call
  return all;
}
#else
JO_DEVICE bool block_all(bool v) { return __syncthreads_and(v) != 0; }
#endif

// A 16-byte register-staged copy, zero-filled when !valid (then src is not
// read). AMD: a vector value, not a struct assigned conditionally; the latter
// is kept in scratch memory by the AMDGPU backend.
#if JO_PLATFORM_HIP
JO_DEVICE void copy16(void* dst, const void* src, bool valid) {
  using U4 = uint32_t __attribute__((ext_vector_type(4)));
  const U4 v = valid ? *static_cast<const U4*>(src) : U4{0u, 0u, 0u, 0u};
  *static_cast<U4*>(dst) = v;
}
#else
JO_DEVICE void copy16(void* dst, const void* src, bool valid) {
  const uint4 v = valid ? *static_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
  *static_cast<uint4*>(dst) = v;
}
#endif

JO_DEVICE float to_float(float v) { return v; }
#if JO_PLATFORM_HIP
JO_DEVICE float to_float(bf16 v) { return static_cast<float>(v); }
JO_DEVICE float to_float(fp16 v) { return static_cast<float>(v); }
template <typename T>
JO_DEVICE T from_float(float v) {
  return static_cast<T>(v);
}
#else
JO_DEVICE float to_float(bf16 v) { return __bfloat162float(v); }
JO_DEVICE float to_float(fp16 v) { return __half2float(v); }
template <typename T>
JO_DEVICE T from_float(float v);
template <>
JO_DEVICE bf16 from_float<bf16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
JO_DEVICE fp16 from_float<fp16>(float v) {
  return __float2half_rn(v);
}
template <>
JO_DEVICE float from_float<float>(float v) {
  return v;
}
#endif

// Two floats rounded to nearest even to this GPU's float8 format, e4m3 or (kE5M2) e5m2, packed `lo` in the low
// byte; a NaN stays NaN. The formats are the GPU's own: OCP on sm_90 and gfx950, fnuz on gfx942 (the same AMD
// instructions). For values within the format's range, which is all the fp8 cast (kernels/fp8_cast.cu) gives it:
// beyond it NVIDIA saturates and AMD does not.
#if JO_PLATFORM_HIP
template <bool kE5M2>
JO_DEVICE uint16_t to_fp8x2(float lo, float hi) {
  const int packed = kE5M2 ? __builtin_amdgcn_cvt_pk_bf8_f32(lo, hi, 0, false)
                           : __builtin_amdgcn_cvt_pk_fp8_f32(lo, hi, 0, false);
  return static_cast<uint16_t>(packed);
}
#else
template <bool kE5M2>
JO_DEVICE uint16_t to_fp8x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, kE5M2 ? __NV_E5M2 : __NV_E4M3);
}
#endif

#endif  // device code

}  // namespace jo::gpu
