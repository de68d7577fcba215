// The vendor BLAS library, resolved at run time. JAX's GPU plugin has already
// loaded it (cuBLASLt from the nvidia-cublas wheel, hipBLASLt from ROCm), so a
// dlopen by soname with RTLD_NOLOAD finds that copy; only when none is loaded
// is it loaded by soname from the library path.
#pragma once

#include <cstdint>
#include <string>

#include "blas/api.h"

namespace jo::blas {

// The entry points, resolved once per process; nullptr with *error naming the
// library and what failed when it cannot be loaded.
const Api* vendor_api(std::string* error);

// What names the loaded library in the tuning cache's header (blas/tuning.h):
// its file and version (0 where the library has no version entry point).
// `handle` is one made by the library (hipBLASLt reports its version through one).
struct LibraryIdentity {
  std::string file;
  int64_t version;
};
LibraryIdentity library_identity(void* handle);

}  // namespace jo::blas
