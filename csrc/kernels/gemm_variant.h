// The compile-time variant of a fused GEMM kernel that one launch needs:
// element type, compiled tile (arch and shape), w's layout, and whether the
// call has peers (world > 1; world 1 runs an instantiation without the
// protocol).
#pragma once

#include <type_traits>

#include "gemm/tile_shapes.h"
#include "kernels/element_type.h"
#include "kernels/params.h"

namespace jo {

// One compiled variant, as a type: fn(GemmVariant<...>{}) in with_gemm_variant.
template <typename T, class TileConfig, gemm::BLayout L, bool kHasPeers>
struct GemmVariant {
  using Elem = T;
  using Config = TileConfig;
  using Mainloop = gemm::MainloopOf<T, TileConfig, L>;
  static constexpr gemm::BLayout kLayout = L;
  static constexpr bool kPeers = kHasPeers;
};

// Calls fn(GemmVariant<T, TileConfig, L, kPeers>{}) for the variant of `op`
// and returns its result; hipErrorInvalidValue when no variant matches (a
// dtype or tile that is not compiled).
template <class Fn>
hipError_t with_gemm_variant(const GemmOperands& op, bool peers, Fn&& fn) {
  hipError_t e = hipErrorInvalidValue;
  with_element_type(op.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    gemm::with_tile_config(op.tile, [&](auto config) {
      using Config = decltype(config);
      auto with_layout = [&](auto layout) {
        constexpr gemm::BLayout L = decltype(layout)::value;
        e = peers ? fn(GemmVariant<T, Config, L, true>{}) : fn(GemmVariant<T, Config, L, false>{});
      };
      if (op.w_kmajor)
        with_layout(std::integral_constant<gemm::BLayout, gemm::BLayout::kKMajor>{});
      else
        with_layout(std::integral_constant<gemm::BLayout, gemm::BLayout::kNMajor>{});
    });
  });
  return e;
}

}  // namespace jo
