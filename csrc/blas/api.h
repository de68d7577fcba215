// The vendor BLAS (cuBLASLt on NVIDIA, hipBLASLt on AMD) as this project calls
// it: the vendor's constants and algorithm type come from one header per
// vendor, the entry points (same shape on both) are declared here and resolved
// at run time by blas/library.cc. The only other file besides platform/gpu.h
// that knows the vendor.
#pragma once

#include <cstddef>
#include <cstdint>

#include "platform/gpu.h"

#if JO_PLATFORM_HIP
#include "blas/hipblaslt_api.h"
#else
#include "blas/cublaslt_api.h"
#endif

namespace jo::blas {

// Opaque handles are pointers on both vendors.
using Handle = void*;
using MatmulDesc = void*;
using Layout = void*;
using Preference = void*;

struct HeuristicResult {
  Algo algo;
  size_t workspace_size;
  LtStatus state;
  float waves_count;
  int reserved[4];
};

struct Api {
  LtStatus (*create)(Handle*);
  LtStatus (*destroy)(Handle);
  LtStatus (*matmul_desc_create)(MatmulDesc*, int compute_type, int scale_type);
  LtStatus (*matmul_desc_destroy)(MatmulDesc);
  LtStatus (*matmul_desc_set_attribute)(MatmulDesc, int attr, const void* value, size_t size);
  LtStatus (*layout_create)(Layout*, int type, uint64_t rows, uint64_t cols, int64_t ld);
  LtStatus (*layout_destroy)(Layout);
  LtStatus (*layout_set_attribute)(Layout, int attr, const void* value, size_t size);
  LtStatus (*preference_create)(Preference*);
  LtStatus (*preference_destroy)(Preference);
  LtStatus (*preference_set_attribute)(Preference, int attr, const void* value, size_t size);
  LtStatus (*algo_get_heuristic)(Handle, MatmulDesc, Layout a, Layout b, Layout c, Layout d, Preference,
                               int requested, HeuristicResult* results, int* returned);
  LtStatus (*matmul)(Handle, MatmulDesc, const void* alpha, const void* a, Layout, const void* b, Layout,
                   const void* beta, const void* c, Layout, void* d, Layout, const Algo*, void* workspace,
                   size_t workspace_bytes, hipStream_t stream);
};

static_assert(sizeof(kApiSymbols) / sizeof(kApiSymbols[0]) * sizeof(void*) == sizeof(Api),
              "one symbol name per entry point, in Api's order");

}  // namespace jo::blas
