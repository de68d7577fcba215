#include "blas/library.h"

#include <dlfcn.h>

namespace jo::blas {
namespace {

struct Loaded {
  Api api{};
  std::string error;  // empty: api is complete
  void* version = nullptr;  // kVersionSymbol, optional
  std::string file;         // the library's file, as the dynamic loader found it
};

void* open_library(std::string* tried) {
  // Prefer the copy JAX's plugin loaded: two copies of one library in a
  // process would each keep their own handles and heuristics cache.
  for (const char* name : kSonames)
    if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) return h;
  for (const char* name : kSonames) {
    if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return h;
    *tried += std::string(tried->empty() ? "" : "; ") + name + ": " + dlerror();
  }
  return nullptr;
}

Loaded load() {
  Loaded out;
  std::string tried;
  void* lib = open_library(&tried);
  if (lib == nullptr) {
    out.error = std::string("jax_overlap: cannot load ") + kLibraryName + " (" + tried +
                "); the pipelined algorithm needs the vendor BLAS that JAX's GPU plugin uses";
    return out;
  }
  void** slots = reinterpret_cast<void**>(&out.api);
  for (size_t i = 0; i < sizeof(kApiSymbols) / sizeof(kApiSymbols[0]); ++i) {
    slots[i] = dlsym(lib, kApiSymbols[i]);
    if (slots[i] == nullptr) {
      out.error = std::string("jax_overlap: ") + kLibraryName + " has no symbol " + kApiSymbols[i];
      return out;
    }
  }
  out.version = dlsym(lib, kVersionSymbol);
  Dl_info info{};
  if (dladdr(slots[0], &info) != 0 && info.dli_fname != nullptr) out.file = info.dli_fname;
  return out;
}

const Loaded& loaded() {
  static const Loaded once = load();  // thread-safe, once per process
  return once;
}

}  // namespace

const Api* vendor_api(std::string* error) {
  const Loaded& l = loaded();
  if (!l.error.empty()) {
    *error = l.error;
    return nullptr;
  }
  return &l.api;
}

LibraryIdentity library_identity(void* handle) {
  const Loaded& l = loaded();
  return LibraryIdentity{l.file, library_version(l.version, handle)};
}

}  // namespace jo::blas
