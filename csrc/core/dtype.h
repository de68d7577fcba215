// The element types jax_overlap knows, at the bottom of every layer: the FFI
// handlers map XLA's data types onto them (ffi/common.h dtype_of), the Python
// module maps jax's dtype names (dtype_from_name), and each path that differs
// per dtype switches over them with no default, so a new dtype is a compile
// error (-Werror=switch) wherever it is not handled yet. A path that does not
// take a dtype says so with an error where it dispatches (the kernels:
// kernels/element_type.h; the vendor GEMM: blas/gemm.cc), never by running
// another dtype's code.
#pragma once

#include <cstddef>
#include <string>

namespace jo {

enum class DType : int { kBF16 = 0, kF16 = 1 };

// Every DType, in enum order.
inline constexpr DType kDTypes[] = {DType::kBF16, DType::kF16};

// jax's name of the dtype ("bfloat16", ...), as Python passes it and messages print it.
inline constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
  }
  return "not a dtype";
}

// Bytes of one element.
inline constexpr int element_bytes(DType t) {
  switch (t) {
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
  }
  return 0;
}

// Every DType's name, "bfloat16 or float16", for messages.
inline std::string dtype_choices() {
  constexpr size_t kCount = sizeof(kDTypes) / sizeof(kDTypes[0]);
  std::string out;
  for (size_t i = 0; i < kCount; ++i)
    out += std::string(i == 0 ? "" : i + 1 == kCount ? " or " : ", ") + dtype_name(kDTypes[i]);
  return out;
}

// The DType jax names `name`; false when no DType has that name.
inline bool dtype_from_name(const std::string& name, DType* out) {
  for (DType t : kDTypes)
    if (name == dtype_name(t)) {
      *out = t;
      return true;
    }
  return false;
}

}  // namespace jo
