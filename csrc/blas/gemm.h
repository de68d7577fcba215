// Row-major GEMMs through the vendor BLAS, for the pipelined algorithm. The
// bias is added in fp32 by the GEMM's epilogue before y is rounded; float8
// scales are device pointers, applied in fp32 before the bias. A plan is made
// once per problem and device and kept for the process.
//
// One handle per stream that runs GEMMs: hipBLASLt keeps its stream-K flags
// per handle, and two streams sharing one deadlock (rocm-libraries #10951).
// Handles are made at prepare() or with the side streams, never in an execute
// handler.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "blas/api.h"
#include "core/gemm_problem.h"
#include "platform/status.h"

namespace jo::blas {

// cuBLAS's own size on sm_90 and hipBLASLt's default; the pipelined calls take
// one per compute stream from their XLA scratch result.
inline constexpr size_t kWorkspaceBytes = size_t{32} << 20;

// cuBLASLt fails a float8 GEMM (NOT_SUPPORTED) whose scale is 4 bytes off
// this alignment, so each scale a GEMM reads sits on a slot of its own.
inline constexpr size_t kScaleAlign = 16;
inline constexpr int kScaleSlot = static_cast<int>(kScaleAlign / sizeof(float));

// For XLA's streams (one per GPU in practice); a further stream shares the
// last one.
inline constexpr int kOriginHandles = 4;

// The largest power of two (16 to 256) that divides every non-null pointer.
int alignment_of(std::initializer_list<const void*> pointers);

// `arch` as gpu::arch_name gives it ("sm_90", "gfx942").
bool takes_fp8(DType t, const std::string& arch);

// A problem's key as one line of text (the tuning cache's and other processes'), and back.
std::string problem_id(const GemmProblem& problem);
bool parse_problem_id(const std::string& text, GemmProblem* out);
std::string describe(const GemmProblem& problem);

// The bias and scales are null where the plan has none.
struct GemmPointers {
  const void* x;
  const void* w;
  const void* bias;
  const float* x_scale;
  const float* w_scale;
  void* y;
};

enum class AlgoSource : int {
  kHeuristic,  // the heuristic's first (tuning off, not tuned, or tuning failed)
  kTimed,      // the fastest of the heuristic's candidates, timed on this GPU
  kDiskCache,  // a timed choice read from the tuning cache on disk
  kInstalled,  // another GPU's or process's choice (install)
};
const char* algo_source_name(AlgoSource source);

class GemmPlan {
 public:
  ~GemmPlan();
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;

  const GemmProblem& problem() const { return problem_; }
  AlgoSource source() const { return source_; }
  int index() const { return index_; }  // the algorithm's place in the heuristic's list
  const Algo& algo() const { return algo_; }

 private:
  friend class DeviceBlas;
  GemmPlan() = default;

  GemmProblem problem_{};
  const Api* api_ = nullptr;
  MatmulDesc desc_ = nullptr;
  Layout a_ = nullptr, b_ = nullptr, d_ = nullptr;
  Algo algo_{};
  AlgoSource source_ = AlgoSource::kHeuristic;
  int index_ = 0;
  // For a later tune() of the problem to report.
  int candidates_ = 0;
  double us_ = 0, first_us_ = 0;
  // The bias and scale pointers are attributes of the shared descriptor: set
  // and used under this lock (uncontended: one thread enqueues a device's
  // calls), and written only when they change (XLA's buffers keep their
  // addresses from call to call).
  mutable std::mutex pointers_mu_;
  mutable const void* set_bias_ = nullptr;
  mutable const void* set_a_scale_ = nullptr;
  mutable const void* set_b_scale_ = nullptr;
};

struct TuningOptions {
  int candidates = 1;      // heuristic results timed; 1: the heuristic's first, nothing timed
  double margin = 0.02;    // another candidate replaces the first only when at least this much faster
  std::string cache_dir;   // the tuning cache's directory; empty: none
};

// `rounds` turns over the candidates, each timing `sample_us` or more of one candidate's back-to-back GEMMs, after
// `warmup_us` of GEMMs: the choice is for the sustained clocks a training step runs at.
struct TimingProtocol {
  double sample_us;
  int rounds;
  double warmup_us;
};
TimingProtocol tuning_protocol();

struct CandidateTime {
  int index = 0;
  size_t workspace_bytes = 0;
  float waves = 0;
  double us = -1;       // -1: not timed
  std::string status;   // "timed", "failed" (did not run), "wrong" (another product), "slow" (left untimed)
};

struct TuneResult {
  std::string choice;    // the algorithm's bytes in hex, for install() on another GPU or process
  AlgoSource source = AlgoSource::kHeuristic;
  int index = 0;         // its place in the heuristic's list
  int candidates = 0;    // how many the heuristic returned
  int timed = 0;         // how many ran right and were timed
  int dropped = 0;       // how many failed to run or computed another product
  double us = 0;         // the choice's median time
  double first_us = 0;   // the heuristic's first's (0 where nothing was timed)
  std::string detail;    // why the heuristic's first was kept without timing, when it was
};

// Process-wide counts (relaxed; off every call's hot path).
struct BlasCounters {
  int64_t plans_made;         // plans made (descriptors and heuristic)
  int64_t plan_lookups;       // plan() calls: made or found
  int64_t descriptor_writes;  // bias or scale pointer attributes written by run()
  int64_t tuned;              // problems whose candidates were timed
  int64_t installs_refused;   // install() choices this GPU's heuristic did not list
  int64_t shared_handles;     // streams past kOriginHandles (sharing a handle)
};
BlasCounters blas_counters();

class DeviceBlas {
 public:
  // Makes the instance and its handles on first call: host work and
  // allocations, never in an execute handler.
  static Status prepare(int ordinal, DeviceBlas** out);
  static Status get(int ordinal, DeviceBlas** out);

  // With tune()'s or install()'s algorithm, else the heuristic's first.
  Status plan(const GemmProblem& problem, const GemmPlan** out);
  // Times the heuristic's candidates (or reads the tuning cache). Host
  // synchronization: lowering-time only. A timing that cannot run keeps the
  // heuristic's first (result->detail says why).
  Status tune(const GemmProblem& problem, const TuningOptions& options, TuneResult* result);
  // Takes another GPU's or process's choice where this GPU's heuristic lists
  // it among its first `candidates` (else *accepted is false).
  Status install(const GemmProblem& problem, const std::string& choice, int candidates, bool* accepted);
  // A tool: the plans stay.
  Status candidate_times(const GemmProblem& problem, int candidates, const TimingProtocol& protocol,
                         std::vector<CandidateTime>* out);

  // `handle`: the stream's own; `workspace`: kWorkspaceBytes.
  Status run(const GemmPlan& plan, const GemmPointers& p, void* workspace, hipStream_t stream, Handle handle) const;

  // One of kOriginHandles, bound to the stream on its first call.
  Handle stream_handle(hipStream_t stream);
  // The tools' handle (timings, tuning, the capture check): one at a time.
  Handle tool_handle() const { return tool_handle_; }
  std::mutex& tool_mu() { return tool_mu_; }
  Status create_handle(Handle* out) const;
  void destroy_handle(Handle handle) const;

  // Bumped when a plan's algorithm is replaced: callers' cached plans are
  // looked up again.
  uint64_t plans_version() const { return plans_version_.load(std::memory_order_acquire); }
  int ordinal() const { return ordinal_; }

 private:
  DeviceBlas() = default;

  Status describe_plan(const GemmProblem& problem, std::unique_ptr<GemmPlan>* out) const;
  Status heuristic(const GemmPlan& plan, int count, std::vector<HeuristicResult>* out) const;
  // Puts `plan` in place of the problem's (mu_ held); the replaced one is kept (callers may hold it).
  const GemmPlan* replace(std::unique_ptr<GemmPlan> plan);
  // tool_mu_ held.
  Status time_candidates(GemmPlan& plan, const std::vector<HeuristicResult>& found, const TimingProtocol& protocol,
                         std::vector<CandidateTime>* out);

  int ordinal_ = 0;
  const Api* api_ = nullptr;
  Handle tool_handle_ = nullptr;
  Handle origin_handles_[kOriginHandles] = {};
  std::atomic<hipStream_t> origin_streams_[kOriginHandles] = {};
  std::mutex mu_;        // guards plans_ and retired_
  std::mutex tool_mu_;   // one tool at a time on tool_handle_
  std::map<GemmProblem, std::unique_ptr<GemmPlan>> plans_;
  std::vector<std::unique_ptr<GemmPlan>> retired_;  // replaced plans: never freed while callers may hold them
  std::atomic<uint64_t> plans_version_{0};
};

}  // namespace jo::blas
