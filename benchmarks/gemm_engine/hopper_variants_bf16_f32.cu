// The variants table of hopper_variants.h for bf16 in, float out (its kernels compile here).
#include "hopper_variants.h"

namespace sm90v {
template std::vector<Entry<bf16, float>> variants<bf16, float>();
}  // namespace sm90v
