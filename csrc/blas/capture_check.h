// Whether the vendor GEMM runs right when XLA records it into a command
// buffer and replays it: hipBLASLt is reported not graph-capture safe under
// JAX (ROCm/TransformerEngine #401), so a group of one lowers to its
// command-buffer target only where this check passed (elsewhere XLA
// dispatches it from the host, about 5 us a call). It runs on both vendors so
// that its failure path runs on NVIDIA too under fault injection.
#pragma once

#include <string>

#include "platform/status.h"

namespace jo::blas {

struct CaptureCheck {
  bool graph_safe = false;
  std::string detail;        // what went wrong when !graph_safe
  bool checked_now = false;  // this call ran the check (the first for the GPU under the faults in effect)
};

// Once per GPU (and per set of faults): a small GEMM whose plan is made inside
// the capture, as a call's may be when XLA records it first, replayed twice
// against the exact product. An error only when the check cannot run or the
// direct run is wrong.
Status check_graph_capture(int ordinal, CaptureCheck* out);

// False once the check failed on a GPU of this process.
bool graph_capture_safe();

}  // namespace jo::blas
