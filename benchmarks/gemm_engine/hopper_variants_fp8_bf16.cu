// The variants table of hopper_variants.h for fp8 in, bf16 out (its kernels compile here).
#include "hopper_variants.h"

namespace sm90v {
template std::vector<Entry<fp8, bf16>> variants<fp8, bf16>();
}  // namespace sm90v
