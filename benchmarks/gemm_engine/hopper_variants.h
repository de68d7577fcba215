// The sm90 GEMM variants hopper_bench.cu compares, one table for every
// (input, output) dtype pair. Each table is instantiated in its own
// translation unit (hopper_variants_*.cu), so that their kernels compile in
// parallel; hopper_bench.cu only reads the tables.
//
// Names: <cluster> <epilogue> <BN>x<stages>[ d<wgmma depth>][ pp]. c1: one CTA
// per cluster; c2m / c2n: clusters of two along M (w's tile multicast) / along
// N (x's tile multicast). direct / tma: the epilogue from registers to global
// memory / through shared memory and TMA stores (epilogue.h). pp: the
// ping-pong schedule (64-row tiles, the consumers in turns), else cooperative.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "gemm/sm90/gemm.h"

namespace sm90v {

using jo::gemm::sm90::Epilogue;
using jo::gemm::sm90::Gemm;
using jo::gemm::sm90::GemmParams;
using jo::gemm::sm90::Variant;
using bf16 = __nv_bfloat16;
using fp8 = __nv_fp8_e4m3;

template <class In, class Out>
using LaunchFn = int (*)(const In*, const In*, const GemmParams<Out>&, int, cudaStream_t, char*, size_t);

template <class In, class Out>
struct Entry {
  const char* name;
  int cluster;     // CTAs per cluster
  bool tma_store;  // needs N * sizeof(Out) % 16 == 0
  LaunchFn<In, Out> launch;  // nullptr: not built for this dtype pair (entry())
};

// launch is nullptr where the variant is not built for this dtype pair: a TMA
// store staging a single slice at a time (fp32 out beside a 200 KB ring: 8
// rounds of barriers) spilled 12 bytes of registers; its bf16 twin is built.
template <class In, class Out, class V>
Entry<In, Out> entry(const char* name) {
  using C = jo::gemm::sm90::Config<In, Out, V>;
  constexpr bool kTma = V::kEpilogue == Epilogue::kTmaStore;
  if constexpr (kTma && C::kEpiBufs < 2) return {name, V::kClusterM * V::kClusterN, kTma, nullptr};
  else return {name, V::kClusterM * V::kClusterN, kTma, &Gemm<In, Out, V>::launch};
}

// What each one isolates (docs/performance.md, "The sm90 mainloop's variants"):
// the two landed kernels; the TMA-store epilogue alone; multicast alone, along
// M and along N; both; a deeper wgmma queue; 224 columns (N = 3584 is 16 such
// tiles: no partial wave at 4096 x 3584); 128 columns; 3 stages with the whole
// tile staged at once; the ping-pong schedule, whose epilogue runs under the
// other consumer's mainloop, at 4 stages (the whole tile staged) and 5.
template <class In, class Out>
std::vector<Entry<In, Out>> variants() {
  constexpr Epilogue D = Epilogue::kDirect, T = Epilogue::kTmaStore;
  constexpr auto PP = jo::gemm::sm90::Schedule::kPingpong;
  return {
      entry<In, Out, Variant<256, 4, 1, 1, D>>("c1 direct 256x4"),
      entry<In, Out, Variant<128, 6, 1, 1, D>>("c1 direct 128x6"),
      entry<In, Out, Variant<256, 4, 1, 1, T>>("c1 tma 256x4"),
      entry<In, Out, Variant<224, 4, 1, 1, T>>("c1 tma 224x4"),
      entry<In, Out, Variant<256, 4, 1, 1, T, 1, PP>>("c1 tma 256x4 pp"),
      entry<In, Out, Variant<256, 4, 2, 1, D>>("c2m direct 256x4"),
      entry<In, Out, Variant<256, 4, 2, 1, T>>("c2m tma 256x4"),
      entry<In, Out, Variant<256, 4, 2, 1, T, 2>>("c2m tma 256x4 d2"),
      entry<In, Out, Variant<256, 3, 2, 1, T>>("c2m tma 256x3"),
      entry<In, Out, Variant<224, 4, 2, 1, T>>("c2m tma 224x4"),
      entry<In, Out, Variant<128, 6, 2, 1, T>>("c2m tma 128x6"),
      entry<In, Out, Variant<256, 4, 2, 1, T, 1, PP>>("c2m tma 256x4 pp"),
      entry<In, Out, Variant<256, 5, 2, 1, T, 1, PP>>("c2m tma 256x5 pp"),
      entry<In, Out, Variant<256, 4, 1, 2, D>>("c2n direct 256x4"),
      entry<In, Out, Variant<256, 4, 1, 2, T>>("c2n tma 256x4"),
      entry<In, Out, Variant<224, 4, 1, 2, T>>("c2n tma 224x4"),
  };
}

extern template std::vector<Entry<bf16, bf16>> variants<bf16, bf16>();
extern template std::vector<Entry<bf16, float>> variants<bf16, float>();
extern template std::vector<Entry<fp8, bf16>> variants<fp8, bf16>();

}  // namespace sm90v
