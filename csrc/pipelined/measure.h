// Timings on one GPU: the figures the cost model is fed with (jax_overlap/
// planning/figures.py) and the one-GPU benchmark of the pipelined schedule. They
// synchronize the host and allocate temporary buffers: lowering-time and
// benchmark tools, never on a call's path.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/params.h"
#include "pipelined/schedule.h"
#include "platform/status.h"

namespace jo::pipelined {

// Median time (us) of one vendor GEMM [rows, k] @ w (+ nothing) of `types`
// (scaled: with scales) for each entry of `rows`, on data that is neither
// zeros nor ones, after about `warmup_ms` of the largest of them back to back
// (measure.cc warm_up). Each GEMM's algorithm is tuned first (blas::DeviceBlas::tune
// with `tuning`), so the times are those of the algorithms the calls run.
Status time_gemms(int ordinal, const GemmTypes& types, const std::vector<int64_t>& rows, int64_t n, int64_t k,
                  bool w_kmajor, int repeats, double warmup_ms, const blas::TuningOptions& tuning,
                  std::vector<double>* us);

// Median time (us) of a copy of `bytes` on `path` (copy.h), in pieces of at
// most `max_piece_bytes`, from `src` (a peer's workspace, or this GPU's
// memory; nullptr: a temporary buffer) into a temporary buffer on GPU
// `ordinal`: the cost model's link and local copy rates are those of the path
// the GPU's pipelined copies take.
Status time_copy(int ordinal, const void* src, uint64_t bytes, int repeats, CopyPath path, uint64_t max_piece_bytes,
                 double* us);

// One copy_2d (copy.h) on GPU `ordinal`, on a stream of its own, waited for (tests).
Status copy_and_wait(int ordinal, CopyPath path, void* dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch,
                     uint64_t width, uint64_t height, uint64_t max_bytes);

// Median time (us) of matmul_rs's reduction (kernels/pipeline_kernels.h) of
// `count` partials of [rows, n] (of partial_dtype(dtype)) into one of `dtype`, on random
// data, timed back to back as time_gemms times the GEMMs (a call's reduction
// follows its GEMMs on a busy GPU: no host latency before it).
Status time_reduce(int ordinal, DType dtype, int count, int64_t rows, int64_t n, int repeats, double* us);

// Median time (us) of the op's schedule in loopback (schedule.h) as rank 0 of
// `world`: the GEMM chunks, the copies (on `path`) and the streams of a real
// call, with this GPU's data standing in for the peers'. back_to_back: per
// call of samples of calls enqueued back to back, as time_gemms times its
// GEMMs and as a training step's calls run (the GPU busy when the host
// enqueues a call); else of one call between two events, waited for, which
// also times the host's enqueue up to the call's first GEMM.
Status time_loopback(int ordinal, OpKind op, const Operands& operands, int world, int repeats, CopyPath path,
                     bool back_to_back, double* us);

// Median host wall time (us) of enqueuing one loopback call (as time_loopback's), calls enqueued back to back:
// where it exceeds the call's GPU time, calls back to back run at the host's pace, not the GPU's.
Status time_loopback_enqueue(int ordinal, OpKind op, const Operands& operands, int world, int repeats, CopyPath path,
                             double* us);

// The cross-stream edges (event records and waits: streams.h) one loopback call of the op enqueues.
Status loopback_edges(int ordinal, OpKind op, const Operands& operands, int world, CopyPath path, StreamEdges* out);

}  // namespace jo::pipelined
