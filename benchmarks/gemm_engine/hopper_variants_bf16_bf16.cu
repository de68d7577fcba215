// The variants table of hopper_variants.h for bf16 in, bf16 out (its kernels compile here).
#include "hopper_variants.h"

namespace sm90v {
template std::vector<Entry<bf16, bf16>> variants<bf16, bf16>();
}  // namespace sm90v
