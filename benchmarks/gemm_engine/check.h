// Error check shared by the GEMM-engine benchmarks: any nonzero status
// (CUDA or cuBLAS) prints where it happened and exits.
#pragma once

#include <cstdio>
#include <cstdlib>

#define CHECK(expr)                                                                                  \
  do {                                                                                               \
    auto _e = (expr);                                                                                \
    if (_e != 0) {                                                                                   \
      std::fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #expr, static_cast<int>(_e)); \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)
