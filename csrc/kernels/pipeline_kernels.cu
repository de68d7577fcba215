#include "kernels/pipeline_kernels.h"

#include <algorithm>

#include "kernels/element_type.h"
#include "kernels/protocol.h"

namespace jo {
namespace {

// Element i of a kernel-parameter array without copying the array to scratch
// memory (a run-time index into a parameter array does that on AMD).
template <typename T>
__device__ __forceinline__ T pick(const T (&values)[kMaxWorld], int i) {
  T out{};
#pragma unroll
  for (int j = 0; j < kMaxWorld; ++j)
    if (j == i) out = values[j];
  return out;
}

// A pipelined flag as a reader waiting for (epoch, site) sees it: the epoch
// acquired first, then the site, so that the site is the one of that
// release (or of a later write to the flag).
__device__ __forceinline__ PipeState read_flag(const PipeFlag* flag, uint32_t epoch, uint32_t site) {
  const uint32_t e = gpu::load_acquire_sys(&flag->epoch);
  if (e != epoch) return PipeState::kPending;
  return pipe_state(e, gpu::load_acquire_sys(&flag->site), epoch, site);
}

// Spins until `flag` is no longer pending for (epoch, site), under the
// watchdog. Pending at the end: the wait gave up (timed out and recorded,
// or another wait of this GPU failed first).
__device__ PipeState wait_flag(const PipeFlag* flag, uint32_t epoch, uint32_t site, const Watchdog& wd,
                               uint32_t rank, uint32_t peer, uint32_t world, WaitOn what) {
  PipeState state = read_flag(flag, epoch, site);
  const uint64_t t0 = gpu::timer_ticks();
  for (uint32_t it = 1; state == PipeState::kPending; ++it) {
    gpu::backoff();
    state = read_flag(flag, epoch, site);
    if ((it & 63) == 0 && state == PipeState::kPending) {
      if (watchdog_fired(wd)) return state;
      const uint64_t waited = gpu::timer_ticks() - t0;
      if (waited > wd.timeout_ticks) {
        record_timeout(wd, rank, peer, world, epoch, what, waited);
        return state;
      }
    }
  }
  return state;
}

// One thread per flag; threads beyond the count only join the exit.
__global__ void pipeline_wait_kernel(FlagWait w) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= w.count) return;
  const uint32_t peer = pick(w.peers, i);
  const PipeState state = wait_flag(pick(w.flags, i), w.epoch, w.site, w.wd, w.rank, peer, w.world, w.what);
  if (state == PipeState::kOtherSite) record_timeout(w.wd, w.rank, peer, w.world, w.epoch, WaitOn::kCallSite, 0);
  if (state == PipeState::kAbandoned) record_timeout(w.wd, w.rank, peer, w.world, w.epoch, WaitOn::kPeerAbandoned, 0);
}

// One thread per flag. The loads come after the pulls (stream order) and
// read the site first, then the epoch: a pull that read any byte of a
// rewrite ran after the writer's kSiteRewriting mark was performed, so the
// site load sees the mark or a later site; a later call site comes only with
// the writer's next release, which wrote the new epoch before it, so the
// epoch load, after the site's acquire, sees that epoch. Either way the flag
// no longer reads (epoch, site). In the other order a release completed
// between the two loads could read as the old epoch with a valid site.
__global__ void pipeline_verify_kernel(FlagVerify v) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= v.count) return;
  const PipeFlag* flag = pick(v.flags, i);
  const uint32_t site = gpu::load_acquire_sys(&flag->site);
  const uint32_t epoch = gpu::load_acquire_sys(&flag->epoch);
  if (epoch != v.epoch || site != v.site) {
    // On a GPU whose wait gave up already this only finds the record claimed.
    const bool abandoned = epoch == v.epoch && site == kSiteAbandoned;
    record_timeout(v.wd, v.rank, pick(v.peers, i), v.world, v.epoch,
                   abandoned ? WaitOn::kPeerAbandoned : WaitOn::kOverwritten, 0);
    return;
  }
  PipeFlag* done = pick(v.done, i);
  gpu::store_release_sys(&done->epoch, v.epoch);
  gpu::store_release_sys(&done->site, v.site);
}

// One thread: an error path, where speed does not matter. Flags this call
// released already become abandoned by their site alone (their epoch is
// this one); the others go through the rewriting mark first, as a release
// does, so no reader sees this epoch with an earlier release's site.
__global__ void pipeline_abandon_kernel(FlagAbandon a) {
  // A wait that gives up (it timed out, or this GPU aborted) lets the marks go ahead all the same.
  for (int i = 0; i < a.reader_count; ++i)
    (void)wait_flag(pick(a.readers_done, i), a.epoch - 2, 0, a.wd, a.rank, pick(a.readers, i), a.world,
                    WaitOn::kReadersDone);
  for (int i = 0; i < a.own_count; ++i) {
    PipeFlag* flag = pick(a.own, i);
    if ((a.released >> i & 1u) == 0) {
      gpu::store_release_sys(&flag->site, kSiteRewriting);
      gpu::store_release_sys(&flag->epoch, a.epoch);
    }
    gpu::store_release_sys(&flag->site, kSiteAbandoned);
  }
  for (int i = 0; i < a.done_count; ++i) {
    (void)wait_flag(pick(a.done_after, i), a.epoch, a.site, a.wd, a.rank, pick(a.done_peers, i), a.world,
                    WaitOn::kPublished);
    PipeFlag* done = pick(a.done, i);
    gpu::store_release_sys(&done->epoch, a.epoch);
    gpu::store_release_sys(&done->site, a.site);
  }
  record_timeout(a.wd, a.rank, a.rank, a.world, a.epoch, WaitOn::kEnqueueFailed, 0);
}

struct PoisonAreas {
  PoisonArea areas[kMaxPoisonAreas];
  int count;
};

// 16-byte vectors where the area's start is aligned to them, bytes elsewhere.
__global__ void pipeline_poison_kernel(const uint32_t* abort, PoisonAreas p) {
  if (*static_cast<const volatile uint32_t*>(abort) == 0) return;
#pragma unroll
  for (int a = 0; a < kMaxPoisonAreas; ++a) {  // unrolled: no run-time index into the parameter array
    if (a >= p.count) break;
    const PoisonArea area = p.areas[a];
    const uint32_t word = 0x01010101u * area.fill;
    const gpu::Vec16 nan{{word, word, word, word}};
    char* base = static_cast<char*>(area.p);
    const uint64_t vecs = reinterpret_cast<uintptr_t>(base) % 16 == 0 ? area.bytes / 16 : 0;
    for (uint64_t i = threadIdx.x; i < vecs; i += blockDim.x)
      gpu::store16(reinterpret_cast<gpu::Vec16*>(base) + i, nan);
    for (uint64_t i = vecs * 16 + threadIdx.x; i < area.bytes; i += blockDim.x) base[i] = static_cast<char>(area.fill);
  }
}

// System-scope loads and stores: a source may be a peer's slot header (read after the wait for its pub flag,
// in an earlier kernel), a destination this rank's own header (read by its peers after the release that follows
// on the stream), as the flags are.
__global__ void pipeline_copy_scales_kernel(ScaleCopy c) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= c.count) return;
  const uint32_t bits = gpu::load_acquire_sys(reinterpret_cast<const uint32_t*>(pick(c.src, i)));
  gpu::store_release_sys(reinterpret_cast<uint32_t*>(pick(c.dst, i)), bits);
}

__global__ void pipeline_pause_kernel(uint64_t ticks) {
  const uint64_t t0 = gpu::timer_ticks();
  while (gpu::timer_ticks() - t0 < ticks) gpu::backoff();
}

__device__ __forceinline__ uint32_t hash_index(uint64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) ^ seed;  // murmur3 finalizer
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

template <typename T>
__global__ void fill_random_kernel(T* p, uint64_t elems, uint32_t seed) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems; i += step)
    p[i] = gpu::from_float<T>(static_cast<float>(hash_index(i, seed) >> 8) * (2.0f / 16777216.0f) - 1.0f);
}

// A float8 value as bits: random sign and mantissa; magnitudes spread over binades as the 16-bit fill's
// uniform [-1, 1) are (half in [0.5, 1), a quarter in [0.25, 0.5), ...), exponent field at least 1 (neither
// zero, NaN nor infinite, in the OCP and the fnuz formats alike). A GEMM's speed depends on its operands' bits
// (the GPU's power): the GEMMs timed here stand for GEMMs on real data, whose exponents cluster so.
__global__ void fill_random_fp8_kernel(uint8_t* p, uint64_t elems, uint32_t seed, int mantissa_bits, int bias) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems; i += step) {
    const uint32_t h = hash_index(i, seed);
    const int below = __ffs(static_cast<int>((h >> 8) | (1u << 20))) - 1;  // j with probability 2^-(j+1)
    const uint32_t exponent = static_cast<uint32_t>(max(1, bias - 1 - below));
    const uint32_t mantissa = h & ((1u << mantissa_bits) - 1);
    p[i] = static_cast<uint8_t>((h >> 31) << 7 | exponent << mantissa_bits | mantissa);
  }
}

constexpr int kCompareThreads = 256;

template <typename T>
__global__ void sum_abs_kernel(const T* want, uint64_t elems, CompareStats* stats) {
  __shared__ double partial[kCompareThreads];
  double sum = 0;
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems; i += step)
    sum += fabs(static_cast<double>(gpu::to_float(want[i])));
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kCompareThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(&stats->sum_abs, partial[0]);
}

template <typename T>
__global__ void mismatch_kernel(const T* got, const T* want, uint64_t elems, float rel, CompareStats* stats) {
  const float mean_abs = static_cast<float>(stats->sum_abs / static_cast<double>(elems));
  unsigned long long wrong = 0;
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems; i += step) {
    const float g = gpu::to_float(got[i]), w = gpu::to_float(want[i]);
    // Written so that NaN fails it.
    if (!(fabsf(g - w) <= rel * (fabsf(w) + mean_abs))) ++wrong;
  }
  if (wrong != 0) atomicAdd(&stats->mismatches, wrong);
}

// The reduction is bound by its loads in flight: each thread issues its loads
// of every partial before the first add. On the H200 that reaches 3.3-4.0
// TB/s of HBM traffic (bench_pipelined); side by side in a lab run, loading
// one partial at a time reached 2.9-3.4, and 2 or 4 vectors per thread (more
// registers, fewer threads resident) less than one.
constexpr int kReduceThreads = 256;

// The partials' type of an output of type T: core/dtype.h partial_dtype (launch_reduce checks they agree).
template <typename T>
struct PartialOf {
  using type = T;
};
template <>
struct PartialOf<gpu::fp16> {
  using type = float;
};

// T: the output's type; P: the partials' (PartialOf<T>: as wide or wider), B: the bias's.
template <typename T, typename P, typename B>
__global__ void pipeline_reduce_kernel(ReduceArgs a) {
  constexpr int kVec = 16 / sizeof(T);                  // outputs per thread: one 16-byte store
  constexpr int kLoads = kVec * sizeof(P) / 16;         // 16-byte loads of each partial for them
  const bool aborted = a.abort != nullptr && *static_cast<const volatile uint32_t*>(a.abort) != 0;
  // n is a multiple of kVec: a vector never straddles a row.
  const int64_t vecs = a.rows * a.n / kVec;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = blockIdx.y; b < a.batch; b += gridDim.y) {
    T* out = static_cast<T*>(a.out) + b * a.rows * a.n;
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs; v += step) {
      const int64_t at = v * kVec;
      const int64_t col = at % a.n;
      gpu::Vec16 raw[kMaxWorld][kLoads];
#pragma unroll
      for (int q = 0; q < kMaxWorld; ++q)
        if (q < a.count)
#pragma unroll
          for (int l = 0; l < kLoads; ++l)
            raw[q][l] = gpu::load16(static_cast<const P*>(a.partials[q]) + b * a.partial_batch_stride[q] + at +
                                    l * (16 / sizeof(P)));
      float acc[kVec] = {};
#pragma unroll
      for (int q = 0; q < kMaxWorld; ++q) {  // rank order
        if (q >= a.count) break;
        P vals[kVec];
        __builtin_memcpy(vals, raw[q], sizeof(vals));
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] += gpu::to_float(vals[i]);
      }
      T sum[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float bias = a.bias != nullptr ? gpu::to_float(static_cast<const B*>(a.bias)[col + i]) : 0.f;
        sum[i] = gpu::from_float<T>(acc[i] + bias);  // the bias, once, after the sum
      }
      gpu::Vec16 packed;
      __builtin_memcpy(&packed, sum, sizeof(packed));
      if (aborted) packed = gpu::Vec16{{~0u, ~0u, ~0u, ~0u}};
      gpu::store16(out + at, packed);
    }
  }
}

// fn(mantissa bits, exponent bias) for a float8 format; false for another dtype.
template <class Fn>
bool with_fp8_bits(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF8E4M3FN: fn(3, 7); return true;
    case DType::kF8E5M2: fn(2, 15); return true;
    case DType::kF8E4M3FNUZ: fn(3, 8); return true;
    case DType::kF8E5M2FNUZ: fn(2, 16); return true;
    case DType::kBF16: return false;
    case DType::kF16: return false;
    case DType::kF32: return false;
  }
  return false;
}

}  // namespace

hipError_t launch_flag_wait(const FlagWait& wait, hipStream_t stream) {
  if (wait.count < 1 || wait.count > kMaxWorld) return hipErrorInvalidValue;
  pipeline_wait_kernel<<<1, gpu::kWarpSize, 0, stream>>>(wait);
  return hipGetLastError();
}

hipError_t launch_flag_verify(const FlagVerify& verify, hipStream_t stream) {
  if (verify.count < 1 || verify.count > kMaxWorld) return hipErrorInvalidValue;
  pipeline_verify_kernel<<<1, gpu::kWarpSize, 0, stream>>>(verify);
  return hipGetLastError();
}

hipError_t launch_flag_abandon(const FlagAbandon& abandon, hipStream_t stream) {
  if (abandon.reader_count > kMaxWorld || abandon.own_count > kMaxWorld || abandon.done_count > kMaxWorld)
    return hipErrorInvalidValue;
  pipeline_abandon_kernel<<<1, 1, 0, stream>>>(abandon);
  return hipGetLastError();
}

hipError_t launch_poison_if_aborted(const uint32_t* abort, const PoisonArea* areas, int count, hipStream_t stream) {
  if (count < 0 || count > kMaxPoisonAreas) return hipErrorInvalidValue;
  PoisonAreas p{};
  for (int i = 0; i < count; ++i) p.areas[i] = areas[i];
  p.count = count;
  // One workgroup: it returns at once unless the call was aborted, when speed no longer matters.
  pipeline_poison_kernel<<<1, 1024, 0, stream>>>(abort, p);
  return hipGetLastError();
}

hipError_t launch_poison_if_aborted(const uint32_t* abort, void* a, uint64_t a_bytes, void* b, uint64_t b_bytes,
                                    hipStream_t stream) {
  const PoisonArea areas[] = {{a, a_bytes, 0xFF}, {b, b_bytes, 0xFF}};
  return launch_poison_if_aborted(abort, areas, 2, stream);
}

hipError_t launch_copy_scales(const ScaleCopy& copy, hipStream_t stream) {
  if (copy.count < 1 || copy.count > kMaxWorld) return hipErrorInvalidValue;
  pipeline_copy_scales_kernel<<<1, gpu::kWarpSize, 0, stream>>>(copy);
  return hipGetLastError();
}

hipError_t launch_pause(uint64_t ticks, hipStream_t stream) {
  pipeline_pause_kernel<<<1, 1, 0, stream>>>(ticks);
  return hipGetLastError();
}

hipError_t launch_fill_random(void* p, uint64_t elems, DType dtype, uint32_t seed, hipStream_t stream) {
  constexpr int kThreads = 256;
  const uint64_t blocks = (elems + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(blocks < 1024 ? blocks : 1024);
  if (grid < 1) return hipSuccess;
  const bool compiled = with_value_type(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    fill_random_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<T*>(p), elems, seed);
  }) || with_fp8_bits(dtype, [&](int mantissa_bits, int bias) {
    fill_random_fp8_kernel<<<grid, kThreads, 0, stream>>>(static_cast<uint8_t*>(p), elems, seed, mantissa_bits, bias);
  });
  return compiled ? hipGetLastError() : hipErrorInvalidValue;
}

hipError_t launch_compare(const void* got, const void* want, uint64_t elems, DType dtype, float rel,
                          CompareStats* stats, hipStream_t stream) {
  const uint64_t blocks = (elems + kCompareThreads - 1) / kCompareThreads;
  const int grid = static_cast<int>(blocks < 1024 ? blocks : 1024);
  if (grid < 1) return hipSuccess;
  const bool compiled = with_value_type(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    sum_abs_kernel<T><<<grid, kCompareThreads, 0, stream>>>(static_cast<const T*>(want), elems, stats);
    mismatch_kernel<T><<<grid, kCompareThreads, 0, stream>>>(static_cast<const T*>(got), static_cast<const T*>(want),
                                                             elems, rel, stats);
  });
  return compiled ? hipGetLastError() : hipErrorInvalidValue;
}

hipError_t launch_reduce(const ReduceArgs& args, int sm_count, hipStream_t stream) {
  hipError_t e = hipErrorInvalidValue;
  with_value_type(args.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int64_t kVec = 16 / sizeof(T);
    if (args.n % kVec) return;
    if (args.bias_dtype != args.dtype && args.bias_dtype != DType::kF32) return;
    // Batch elements along y, each one's 16-byte vectors along x; about 4
    // workgroups per CU in all, each thread looping over its share.
    const int64_t vecs = args.rows * args.n / kVec;
    if (vecs < 1 || args.batch < 1) {
      e = hipSuccess;
      return;
    }
    const int64_t grid_y = std::min<int64_t>(args.batch, 65535);
    const int64_t grid_x = std::min((vecs + kReduceThreads - 1) / kReduceThreads,
                                    std::max<int64_t>(4 * static_cast<int64_t>(sm_count) / grid_y, 1));
    const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
    using P = typename PartialOf<T>::type;
    if (element_bytes(partial_dtype(args.dtype)) != static_cast<int>(sizeof(P))) return;
    if (args.bias_dtype == DType::kF32)
      pipeline_reduce_kernel<T, P, float><<<grid, kReduceThreads, 0, stream>>>(args);
    else
      pipeline_reduce_kernel<T, P, T><<<grid, kReduceThreads, 0, stream>>>(args);
    e = hipGetLastError();
  });
  return e;
}

}  // namespace jo
