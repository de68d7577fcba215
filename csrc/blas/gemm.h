// Row-major GEMMs through the vendor BLAS, for the pipelined algorithm: one
// GemmProblem (core/gemm_problem.h) per plan, the bias added by the GEMM's
// epilogue in fp32 before y is rounded; float8 operands with their scales as
// device pointers (the vendor's A and B scale: the product is scaled in fp32
// before the bias is added), or with block scales (core/block_scales.h;
// cuBLASLt only, no bias). A plan (descriptors and an algorithm) is made once
// per problem and device and kept for the process: its algorithm is the
// vendor heuristic's first unless tune() measured a faster one of the
// heuristic's candidates on this GPU (blas/tuning.h), or install() took
// another process's choice (every rank runs the same algorithm).
//
// Handles: one per stream that runs GEMMs (hipBLASLt keeps its stream-K
// flags per handle, and two streams sharing one deadlock: rocm-libraries
// #10951; cuBLASLt takes the same rule). All are made at prepare(), outside
// any execute handler: kOriginHandles for XLA's streams, bound to a stream on
// its first call; one for the tools (timings, tuning, the capture check), each
// on a stream of its own and one at a time; the pipelined side streams make
// theirs with create_handle() when they are made (pipelined/streams.h).
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

// Workspace of one GEMM in flight (cuBLAS's own size on sm_90 and hipBLASLt's
// default); the pipelined calls take one per compute stream from their XLA
// scratch result, so nothing is allocated per call.
inline constexpr size_t kWorkspaceBytes = size_t{32} << 20;

// The alignment run() requires of a float8 GEMM's scale pointers: cuBLASLt's
// fails the call (NOT_SUPPORTED) for a scale 4 bytes off one (seen on the
// H200), so scales a GEMM reads each sit on a slot of their own.
inline constexpr size_t kScaleAlign = 16;
// Floats from one scale to the next where scales sit side by side on such slots.
inline constexpr int kScaleSlot = static_cast<int>(kScaleAlign / sizeof(float));

// Handles per GPU for the streams XLA gives the calls (one compute stream per
// GPU in practice); a further stream shares the last one (counted:
// BlasCounters::shared_handles).
inline constexpr int kOriginHandles = 4;

// The largest power of two (16 to 256) that divides every non-null pointer.
int alignment_of(std::initializer_list<const void*> pointers);

// Whether the vendor GEMM takes float8 operands of format `t` on a GPU of architecture `arch` ("sm_90",
// "gfx942"; gpu::arch_name).
bool takes_fp8(DType t, const std::string& arch);

// A problem as one line of text, every field of its key (a plan's key in the tuning cache and between
// processes), and back; false for text that is not one.
std::string problem_id(const GemmProblem& problem);
bool parse_problem_id(const std::string& text, GemmProblem* out);
// A problem in words, for messages.
std::string describe(const GemmProblem& problem);

// One GEMM's operands: x, w, y, and the bias and the scales where the plan has them (else null).
struct GemmPointers {
  const void* x;
  const void* w;
  const void* bias;
  const float* x_scale;
  const float* w_scale;
  void* y;
};

// How a plan's algorithm was chosen.
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
  // What tune() found (TuneResult), for a later tune() of the problem to report.
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

// How tune() chooses (jax_overlap/runtime/settings.py names the settings).
struct TuningOptions {
  int candidates = 1;      // heuristic results timed; 1: the heuristic's first, nothing timed
  double margin = 0.02;    // another candidate replaces the first only when at least this much faster
  std::string cache_dir;   // the tuning cache's directory; empty: none
};

// How the candidates are timed (blas/tuning.cc): `rounds` turns over the candidates, each timing `sample_us` or
// more of one candidate's back-to-back GEMMs, after `warmup_us` of the heuristic's first back to back (the GPU's
// clocks settle under sustained GEMMs: the choice is for the clocks a training step runs at).
struct TimingProtocol {
  double sample_us;
  int rounds;
  double warmup_us;
};
// tune()'s.
TimingProtocol tuning_protocol();

// One candidate as timed: its place in the heuristic's list, what the heuristic said of it, its median time.
struct CandidateTime {
  int index = 0;
  size_t workspace_bytes = 0;
  float waves = 0;
  double us = -1;       // -1: not timed
  std::string status;   // "timed", "failed" (did not run), "wrong" (another product), "slow" (left untimed)
};

// What tune() chose for a problem.
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

// One GPU's vendor BLAS: its handles and the plans made on it.
class DeviceBlas {
 public:
  // The instance of GPU `ordinal`, made the first time with its handles
  // (host work and allocations: at lowering, initialize() or in the tools,
  // never in an execute handler). Fault "blas_handle_fails": a handle cannot
  // be made.
  static Status prepare(int ordinal, DeviceBlas** out);
  // The instance prepare() made; an error before it did.
  static Status get(int ordinal, DeviceBlas** out);

  // The plan of `problem` (its alignment set): the algorithm tune() or
  // install() chose for it, else the heuristic's first, made on first use;
  // an error for a dtype the vendor GEMM path does not take.
  Status plan(const GemmProblem& problem, const GemmPlan** out);
  // Chooses the algorithm of `problem` by timing the heuristic's candidates
  // on this GPU (blas/tuning.cc), or reads the choice from the tuning cache;
  // its plan from then on runs it. Host synchronization and temporary
  // buffers: lowering-time only. A timing that cannot run keeps the
  // heuristic's first (result->detail says why); an error only when the
  // problem has no plan at all.
  Status tune(const GemmProblem& problem, const TuningOptions& options, TuneResult* result);
  // Makes `choice` (TuneResult::choice from another GPU or process) the
  // algorithm of `problem` here when this GPU's heuristic lists it among
  // its first `candidates`; otherwise keeps the plan's algorithm
  // (*accepted false).
  Status install(const GemmProblem& problem, const std::string& choice, int candidates, bool* accepted);
  // The heuristic's first `candidates` for `problem`, each timed under `protocol` (a tool: the plans stay).
  Status candidate_times(const GemmProblem& problem, int candidates, const TimingProtocol& protocol,
                         std::vector<CandidateTime>* out);

  // Enqueues the plan's GEMM of `p` on `stream` with `handle` (the stream's
  // own); `workspace` holds kWorkspaceBytes.
  Status run(const GemmPlan& plan, const GemmPointers& p, void* workspace, hipStream_t stream, Handle handle) const;

  // The handle of XLA's stream `stream`: one of kOriginHandles, bound to it on
  // its first call (no handle is made here).
  Handle stream_handle(hipStream_t stream);
  // The tools' handle (timings, tuning, the capture check): one at a time.
  Handle tool_handle() const { return tool_handle_; }
  std::mutex& tool_mu() { return tool_mu_; }
  // A handle of its own for a stream (pipelined/streams.h), and its release.
  Status create_handle(Handle* out) const;
  void destroy_handle(Handle handle) const;

  // Bumped whenever a plan's algorithm is replaced (tune, install): plans
  // cached by callers (ffi/pipelined.cc) are looked up again.
  uint64_t plans_version() const { return plans_version_.load(std::memory_order_acquire); }
  int ordinal() const { return ordinal_; }

 private:
  DeviceBlas() = default;

  // A plan of `problem`'s descriptors, its algorithm not yet set.
  Status describe_plan(const GemmProblem& problem, std::unique_ptr<GemmPlan>* out) const;
  // The heuristic's first `count` candidates for `plan` (state success only).
  Status heuristic(const GemmPlan& plan, int count, std::vector<HeuristicResult>* out) const;
  // Puts `plan` in place of the problem's (mu_ held); the replaced one is kept (callers may hold it).
  const GemmPlan* replace(std::unique_ptr<GemmPlan> plan);
  // Times `found` on this GPU under `protocol` (blas/tuning.cc); tool_mu_ held.
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
