// The ops jax_overlap runs. Code that differs per op switches over OpKind with
// no default, so a new op is a compile error (-Werror=switch) wherever it is
// not handled yet. The values are kept in error records (core/error_record.h).
#pragma once

#include <cstdint>

namespace jo {

enum class OpKind : uint32_t { kAgMatmul = 1, kMatmulRs = 2, kAllGather = 3 };

// The op's name in jax_overlap ("ag_matmul", ...); `op` as an error record holds it.
inline const char* op_name(uint32_t op) {
  switch (static_cast<OpKind>(op)) {
    case OpKind::kAgMatmul: return "ag_matmul";
    case OpKind::kMatmulRs: return "matmul_rs";
    case OpKind::kAllGather: return "all_gather";
  }
  return "unknown op";
}
inline const char* op_name(OpKind op) { return op_name(static_cast<uint32_t>(op)); }

}  // namespace jo
