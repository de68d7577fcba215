// Timings on one GPU: the figures the cost model is fed with (jax_overlap/
// calibration.py) and the one-GPU benchmark of the pipelined schedule. They
// synchronize the host and allocate temporary buffers: lowering-time and
// benchmark tools, never on a call's path.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/params.h"
#include "pipelined/schedule.h"
#include "platform/status.h"

namespace jo::pipelined {

// Median time (us) of one vendor GEMM [rows, k] @ w (+ nothing) for each entry
// of `rows`, on data that is neither zeros nor ones, after about `warmup_ms`
// of the largest of them back to back (measure.cc warm_up).
Status time_gemms(int ordinal, DType dtype, const std::vector<int64_t>& rows, int64_t n, int64_t k, bool w_kmajor,
                  int repeats, double warmup_ms, std::vector<double>* us);

// Median time (us) of a copy-engine copy of `bytes` from `src` (a peer's
// workspace, or this GPU's memory; nullptr: a temporary buffer) into a
// temporary buffer on GPU `ordinal`.
Status time_copy(int ordinal, const void* src, uint64_t bytes, int repeats, double* us);

// Median time (us) of matmul_rs's reduction (kernels/pipeline_kernels.h) of
// `count` partials of [rows, n] into one, on random data.
Status time_reduce(int ordinal, DType dtype, int count, int64_t rows, int64_t n, int repeats, double* us);

// Median time (us) of the op's schedule in loopback (schedule.h) as rank 0 of
// `world`: the GEMM chunks, the copies and the streams of a real call, with
// this GPU's data standing in for the peers'.
Status time_loopback(int ordinal, OpKind op, const Operands& operands, int world, int repeats, double* us);

}  // namespace jo::pipelined
