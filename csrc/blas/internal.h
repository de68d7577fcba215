// What blas/gemm.cc and blas/tuning.cc share: the error macro of the vendor's
// status codes, descriptor attributes, and the process-wide counts behind
// blas_counters(). Internal to csrc/blas.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "blas/api.h"
#include "platform/status.h"

namespace jo::blas {

#define JO_RETURN_IF_BLAS_ERROR(expr)                                                                    \
  do {                                                                                                   \
    const ::jo::blas::LtStatus jo_blas_status_ = (expr);                                                 \
    if (jo_blas_status_ != ::jo::blas::kSuccess)                                                         \
      return ::jo::Status{std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " #expr " failed: " + \
                          ::jo::blas::kLibraryName + " status " + std::to_string(jo_blas_status_)};      \
  } while (0)

template <typename V>
Status set_desc(const Api& api, MatmulDesc desc, int attr, V value) {
  JO_RETURN_IF_BLAS_ERROR(api.matmul_desc_set_attribute(desc, attr, &value, sizeof(value)));
  return {};
}

struct Counts {
  std::atomic<int64_t> plans_made{0}, plan_lookups{0}, descriptor_writes{0}, tuned{0}, installs_refused{0},
      shared_handles{0};
};
Counts& counts();

}  // namespace jo::blas
