// The vendor BLAS library, resolved at run time. JAX's GPU plugin has already
// loaded it (cuBLASLt from the nvidia-cublas wheel, hipBLASLt from ROCm), so a
// dlopen by soname with RTLD_NOLOAD finds that copy; only when none is loaded
// is it loaded by soname from the library path.
#pragma once

#include <string>

#include "blas/api.h"

namespace jo::blas {

// The entry points, resolved once per process; nullptr with *error naming the
// library and what failed when it cannot be loaded.
const Api* vendor_api(std::string* error);

}  // namespace jo::blas
