// The host-side error type: a message, empty on success, with the macros that
// turn a failing HIP/CUDA call into one naming the file, line and expression.
#pragma once

#include <string>

#include "platform/gpu.h"

namespace jo {

struct Status {
  std::string message;
  bool ok() const { return message.empty(); }
};

// "file:line: expr failed: <runtime message>" for any failing HIP/CUDA call. The runtime also keeps
// a failure as the thread's last error, which every later launch check (hipGetLastError after a
// kernel launch) would read as its own: a failed allocation in initialize() made the next set-up's
// first launch fail with "out of memory" (tests/gpu/scenarios/agree.py). The error is reported
// here, so it is taken off the thread (a sticky error, one that broke the context, stays).
#define JO_RETURN_IF_HIP_ERROR(expr)                                                                  \
  do {                                                                                                \
    const hipError_t jo_err_ = (expr);                                                                \
    if (jo_err_ != hipSuccess) {                                                                      \
      (void)hipGetLastError();                                                                        \
      return ::jo::Status{std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " #expr " failed: " + \
                          hipGetErrorString(jo_err_)};                                                \
    }                                                                                                 \
  } while (0)

#define JO_RETURN_IF_ERROR(expr)            \
  do {                                      \
    ::jo::Status jo_status_ = (expr);       \
    if (!jo_status_.ok()) return jo_status_; \
  } while (0)

}  // namespace jo
