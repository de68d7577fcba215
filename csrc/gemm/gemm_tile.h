// One output tile of y = a_rows @ w (+ bias): the mainloop plus the epilogue,
// shared by the plain GEMM path (world 1) of both fused kernels and by the
// engine benchmark.
#pragma once

#include "gemm/epilogue.h"
#include "gemm/tile_engine.h"

namespace jo::gemm {

// RowFn(tile_row) -> const T* (row start) or nullptr; OutRowFn(tile_row) ->
// T* (output row start) or nullptr for rows beyond the matrix.
template <class Eng, typename T, class RowFn, class OutRowFn, class WaitA>
__device__ __forceinline__ void gemm_tile(T* smem, RowFn&& a_row, const typename Eng::BSource& b, int K,
                                          OutRowFn&& out_row, const T* bias, WaitA&& wait_a) {
  const auto rows = Eng::a_rows(a_row);
  typename Eng::Acc acc;
  Eng::mainloop(acc, smem, rows, b, K, wait_a);
  Eng::for_each_acc(acc, out_row, [&](T* dst, int c, const float* v) {
    const int col = b.n0 + c;
    if (dst != nullptr && col < b.N)
      store_vec<T, Eng::Atom::kCVec>(dst + col, v, bias != nullptr ? bias + col : nullptr);
  });
}

}  // namespace jo::gemm
