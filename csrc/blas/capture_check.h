// Whether the vendor GEMM runs right when XLA records it into a command
// buffer (a CUDA/HIP graph captured from its stream) and replays it. hipBLASLt
// is reported not graph-capture safe under JAX (ROCm/TransformerEngine #401),
// so a group of one's pipelined call (the vendor GEMM alone) lowers to its
// command-buffer target only on GPUs where this check passed; elsewhere XLA
// dispatches it from the host (about 5 us a call). The check runs at lowering,
// outside any capture, on both vendors (cheap: one small GEMM), so that its
// failure path runs on NVIDIA too under fault injection.
#pragma once

#include <string>

#include "platform/status.h"

namespace jo::blas {

struct CaptureCheck {
  bool graph_safe = false;
  std::string detail;        // what went wrong when !graph_safe
  bool checked_now = false;  // this call ran the check (the first for the GPU under the faults in effect)
};

// The check on GPU `ordinal`, run once per GPU (again when the faults in
// effect change): a small GEMM captured into a graph on a stream of its own,
// its plan made inside the capture as a call's may be when XLA records it
// first; the graph replayed twice, each replay's output compared with the
// exact product; then a direct run compared the same way. An error only when
// the check cannot run, or the direct run itself is wrong.
Status check_graph_capture(int ordinal, CaptureCheck* out);

// False once the check failed on a GPU of this process under the faults in
// effect (true before any check: nothing known against the graph).
bool graph_capture_safe();

}  // namespace jo::blas
