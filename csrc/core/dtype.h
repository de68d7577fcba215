// The element types jax_overlap knows. Every path that differs per dtype
// switches over them with no default, so a new dtype is a compile error
// (-Werror=switch) wherever it is not handled yet; a path that does not take
// one says so where it dispatches, never by running another dtype's code.
//
// Roles: the 16-bit types are operands and outputs alike; the float8 formats
// operands only, with a float32 scale each; float32 an output (and bias) only.
#pragma once

#include <cstddef>
#include <string>

namespace jo {

enum class DType : int {
  kBF16 = 0,
  kF16 = 1,
  kF8E4M3FN = 2,    // OCP e4m3 (NVIDIA sm_89+, gfx950)
  kF8E5M2 = 3,      // OCP e5m2
  kF8E4M3FNUZ = 4,  // gfx942's e4m3 (no negative zero, one NaN, exponent bias 8)
  kF8E5M2FNUZ = 5,  // gfx942's e5m2 (exponent bias 16)
  kF32 = 6,
};

// Every DType, in enum order.
inline constexpr DType kDTypes[] = {DType::kBF16,       DType::kF16,        DType::kF8E4M3FN, DType::kF8E5M2,
                                    DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ, DType::kF32};

// jax's name of the dtype ("bfloat16", ...), as Python passes it and messages print it.
inline constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kF8E4M3FN: return "float8_e4m3fn";
    case DType::kF8E5M2: return "float8_e5m2";
    case DType::kF8E4M3FNUZ: return "float8_e4m3fnuz";
    case DType::kF8E5M2FNUZ: return "float8_e5m2fnuz";
    case DType::kF32: return "float32";
  }
  return "not a dtype";
}

// Bytes of one element.
inline constexpr int element_bytes(DType t) {
  switch (t) {
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF8E4M3FN: return 1;
    case DType::kF8E5M2: return 1;
    case DType::kF8E4M3FNUZ: return 1;
    case DType::kF8E5M2FNUZ: return 1;
    case DType::kF32: return 4;
  }
  return 0;
}

enum class Role : int { kOperandAndOutput, kOperand, kOutput };

// What a dtype can be in a GEMM (the roles above).
inline constexpr Role dtype_role(DType t) {
  switch (t) {
    case DType::kBF16: return Role::kOperandAndOutput;
    case DType::kF16: return Role::kOperandAndOutput;
    case DType::kF8E4M3FN: return Role::kOperand;
    case DType::kF8E5M2: return Role::kOperand;
    case DType::kF8E4M3FNUZ: return Role::kOperand;
    case DType::kF8E5M2FNUZ: return Role::kOperand;
    case DType::kF32: return Role::kOutput;
  }
  return Role::kOutput;
}

// A byte whose repetition is a NaN of the dtype: outputs of a failed call are filled with it.
inline constexpr unsigned char nan_fill_byte(DType t) {
  switch (t) {
    case DType::kBF16: return 0xFF;
    case DType::kF16: return 0xFF;
    case DType::kF8E4M3FN: return 0xFF;
    case DType::kF8E5M2: return 0xFF;
    case DType::kF8E4M3FNUZ: return 0x80;  // the fnuz formats' only NaN; 0xFF is their most negative value
    case DType::kF8E5M2FNUZ: return 0x80;
    case DType::kF32: return 0xFF;
  }
  return 0xFF;
}

// The type each rank's partial product of a reduction (matmul_rs) is staged in for an output of type `out`:
// float32 for float16, whose 65504 a partial may pass while the sum of the partials does not; the output's type
// otherwise (bfloat16 has float32's range). jax_overlap/quantization/formats.py partial agrees.
inline constexpr DType partial_dtype(DType out) { return out == DType::kF16 ? DType::kF32 : out; }

// A float8 format: an operand that comes with a float32 scale.
inline constexpr bool is_fp8(DType t) { return dtype_role(t) == Role::kOperand; }
// A GEMM's x and w: the 16-bit types and the float8 formats.
inline constexpr bool is_operand(DType t) { return dtype_role(t) != Role::kOutput; }
// A GEMM's y: the 16-bit types and float32.
inline constexpr bool is_output(DType t) { return dtype_role(t) != Role::kOperand; }

// The DTypes for which `keep(t)` holds, by name, "bfloat16, float16 or float32", for messages.
template <class Keep>
std::string dtype_choices(Keep&& keep) {
  std::string out;
  const char* last = nullptr;
  for (DType t : kDTypes) {
    if (!keep(t)) continue;
    if (last != nullptr) out += std::string(out.empty() ? "" : ", ") + last;
    last = dtype_name(t);
  }
  if (last == nullptr) return out;
  return out.empty() ? std::string(last) : out + " or " + last;
}
inline std::string dtype_choices() {
  return dtype_choices([](DType) { return true; });
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
