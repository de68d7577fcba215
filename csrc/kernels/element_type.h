// The element types the kernels compile for each DType they take.
#pragma once

#include "core/dtype.h"
#include "platform/gpu.h"

namespace jo {

template <typename T>
struct TypeTag {
  using type = T;
};

// The fused kernels' element types: calls fn(TypeTag<T>{}) with the type of
// `dtype` and returns true; false for a dtype they are not compiled for (the
// launcher's error; their FFI handlers refuse such calls first, by name).
template <class Fn>
bool with_element_type(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBF16: fn(TypeTag<gpu::bf16>{}); return true;
    case DType::kF16: fn(TypeTag<gpu::fp16>{}); return true;
    case DType::kF8E4M3FN: return false;
    case DType::kF8E5M2: return false;
    case DType::kF8E4M3FNUZ: return false;
    case DType::kF8E5M2FNUZ: return false;
    case DType::kF32: return false;
  }
  return false;
}

// The types the pipelined algorithm's own kernels compute in (the reduction
// of matmul_rs's partials, random fills): GEMM outputs, and a float32 bias.
// The float8 formats are moved as bytes only, never computed with: false.
template <class Fn>
bool with_value_type(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBF16: fn(TypeTag<gpu::bf16>{}); return true;
    case DType::kF16: fn(TypeTag<gpu::fp16>{}); return true;
    case DType::kF32: fn(TypeTag<float>{}); return true;
    case DType::kF8E4M3FN: return false;
    case DType::kF8E5M2: return false;
    case DType::kF8E4M3FNUZ: return false;
    case DType::kF8E5M2FNUZ: return false;
  }
  return false;
}

}  // namespace jo
