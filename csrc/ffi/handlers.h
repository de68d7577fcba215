// The FFI handler symbols and the one table that names their targets.
#pragma once

#include <cstdint>
#include <vector>

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JoAgMatmulInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoAgMatmulExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoAgMatmulLocalExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoMatmulRsInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoMatmulRsExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoMatmulRsLocalExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoAllGatherInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoAllGatherExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoAgMatmulPipelinedInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoMatmulRsPipelinedInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoAgMatmulPipelinedExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoMatmulRsPipelinedExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoVendorGemmExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoVendorGemmNoGraphExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoFp8CastExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoFp8CastAmaxExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoFp8CastAmaxTransposedExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoFp8CastAmaxFromExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoFp8CastAmaxFromTransposedExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoFp8StepScalesExecute);

namespace jo {

// Executions of the vendor_gemm targets, how many of them XLA recorded under
// stream capture into a command buffer (what its compiled HLO text no longer
// shows: it forms command buffers from thunks, after the HLO), and the host
// time they took inside the handler (what a call costs beyond XLA's dispatch).
struct VendorGemmRuns {
  int64_t runs, captured;
  int64_t handler_ns;  // host time inside the handler over those runs (the capture query excluded)
  int64_t vendor_ns;   // of which in the vendor GEMM's call (cublasLtMatmul / hipblasLtMatmul)
};
VendorGemmRuns vendor_gemm_runs();
// Whether the vendor_gemm targets count their executions (tests: off by default, the capture query costs host
// time on every call).
void count_vendor_gemm_runs(bool on);

struct FfiTarget {
  const char* op;      // what jax_overlap calls it
  const char* target;  // the XLA custom-call target name
  XLA_FFI_Handler* instantiate;  // nullptr: stateless
  XLA_FFI_Handler* execute;
};

inline const std::vector<FfiTarget>& ffi_targets() {
  static const std::vector<FfiTarget> targets = {
      {"ag_matmul", "jax_overlap_ag_matmul", JoAgMatmulInstantiate, JoAgMatmulExecute},
      {"matmul_rs", "jax_overlap_matmul_rs", JoMatmulRsInstantiate, JoMatmulRsExecute},
      // Groups of one of the fused kernels: no protocol, but this GPU's abort flag, error record and trace
      // buffer, which jax_overlap.shutdown() frees: XLA dispatches them (no command buffer), so that each
      // run checks the runtime generation it was lowered under.
      {"ag_matmul_local", "jax_overlap_ag_matmul_local", nullptr, JoAgMatmulLocalExecute},
      {"matmul_rs_local", "jax_overlap_matmul_rs_local", nullptr, JoMatmulRsLocalExecute},
      {"all_gather", "jax_overlap_all_gather", JoAllGatherInstantiate, JoAllGatherExecute},
      // The pipelined algorithm; its group of one is the vendor GEMM alone, command-buffer compatible where
      // the vendor GEMM passed its capture check on every local GPU (blas/capture_check.h), else the second.
      {"ag_matmul_pipelined", "jax_overlap_ag_matmul_pipelined", JoAgMatmulPipelinedInstantiate,
       JoAgMatmulPipelinedExecute},
      {"matmul_rs_pipelined", "jax_overlap_matmul_rs_pipelined", JoMatmulRsPipelinedInstantiate,
       JoMatmulRsPipelinedExecute},
      {"vendor_gemm", "jax_overlap_vendor_gemm", nullptr, JoVendorGemmExecute},
      {"vendor_gemm_no_graph", "jax_overlap_vendor_gemm_no_graph", nullptr, JoVendorGemmNoGraphExecute},
      // The fp8 layers' float8 cast (kernels/fp8_cast.h).
      {"fp8_cast", "jax_overlap_fp8_cast", nullptr, JoFp8CastExecute},
      // Its variant with amax(|x|) from the same pass, saturating: the delayed-scaling layers' casts.
      {"fp8_cast_amax", "jax_overlap_fp8_cast_amax", nullptr, JoFp8CastAmaxExecute},
      // And its transposing variant: a weight cast into the GEMM's K-major layout, amax from the same pass.
      {"fp8_cast_amax_transposed", "jax_overlap_fp8_cast_amax_transposed", nullptr, JoFp8CastAmaxTransposedExecute},
      // The two with their amax starting from a given value (the step kernel's zero: no memset).
      {"fp8_cast_amax_from", "jax_overlap_fp8_cast_amax_from", nullptr, JoFp8CastAmaxFromExecute},
      {"fp8_cast_amax_from_transposed", "jax_overlap_fp8_cast_amax_from_transposed", nullptr,
       JoFp8CastAmaxFromTransposedExecute},
      // The delayed-scaling step before the casts: the step's scales and zeroed amaxes (kernels/fp8_scales.h).
      {"fp8_step_scales", "jax_overlap_fp8_step_scales", nullptr, JoFp8StepScalesExecute},
  };
  return targets;
}

}  // namespace jo
