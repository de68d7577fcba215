// The element type the kernels compile for each DType they take.
#pragma once

#include "core/dtype.h"
#include "platform/gpu.h"

namespace jo {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<T>{}) with the element type of `dtype` and returns true;
// false for a dtype the kernels are not compiled for (the launcher's error).
template <class Fn>
bool with_element_type(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBF16: fn(TypeTag<gpu::bf16>{}); return true;
    case DType::kF16: fn(TypeTag<gpu::fp16>{}); return true;
  }
  return false;
}

}  // namespace jo
