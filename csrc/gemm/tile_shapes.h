// The block tiles compiled into the kernels, by index (the `tile` field of a
// fused call's config): each built arch's tile list (gemm/arch_traits.h) in
// turn, the build's own arch first. In a CUDA build, indices 0-1 are
// NvidiaArch's and 2-3 the AMD data path on the mma.sync atom, which the
// planner takes only when asked (jax_overlap/runtime/backend.py tiles_for_arch).
#pragma once

#include <utility>

#include "gemm/arch_traits.h"
#include "gemm/mainloop.h"

namespace jo::gemm {

// A compiled tile: the arch that runs it and its shape.
template <class Arch_, class Shape_>
struct TileConfig {
  using Arch = Arch_;
  using Shape = Shape_;
};

template <class... Archs>
constexpr int tile_count(ArchList<Archs...>) {
  return (Archs::Tiles::kCount + ...);
}
inline constexpr int kTileCount = tile_count(BuiltArchs{});

// fn(TileConfig<Arch, Shape>{}) for the tile with this index among Arch's.
template <class Arch, class Fn, class... Shapes>
bool with_arch_tile(int index, TileList<Shapes...>, Fn& fn) {
  int i = 0;
  return ((index == i++ ? (fn(TileConfig<Arch, Shapes>{}), true) : false) || ...);
}

template <class Fn, class... Archs>
bool with_built_tile(int index, ArchList<Archs...>, Fn& fn) {
  int first = 0;  // index of the arch's first tile
  return (with_arch_tile<Archs>(index - std::exchange(first, first + Archs::Tiles::kCount), typename Archs::Tiles{},
                                fn) ||
          ...);
}

// The mainloop of a compiled tile for element type T and w's layout L.
template <typename T, class Config, BLayout L>
using MainloopOf = Mainloop<T, typename Config::Arch, typename Config::Shape, L>;

// Calls fn(TileConfig<Arch, Shape>{}) for the tile with this index; false if none.
template <class Fn>
bool with_tile_config(int index, Fn&& fn) {
  return with_built_tile(index, BuiltArchs{}, fn);
}

}  // namespace jo::gemm
