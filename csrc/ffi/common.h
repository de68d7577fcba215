// Pieces every FFI handler shares: the per-call state, error conversion, the
// config attribute, and what happens around a launch.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/gemm_problem.h"
#include "core/scale_mode.h"
#include "kernels/params.h"
#include "runtime/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jo {

namespace ffi = ::xla::ffi;

// Launch configuration of a fused call (jax_overlap/planning/fused.py FusedPlan plus
// the region the runtime placed for it), decoded from the "config" attribute.
struct FusedConfig {
  int64_t tile;
  int64_t comm_workgroups;  // fetchers (ag_matmul) or reducers (matmul_rs)
  int64_t chunk_k;
  int64_t w_kmajor;
  int64_t region_offset;
  int64_t region_bytes;
  int64_t site;        // this call site's number among those sharing the region (0 for world 1)
  int64_t tail_slots;  // group of one: workgroup slots of its stream-K tail scratch (0: none)
  int64_t generation;  // the runtime generation the call was lowered under (Runtime::generation)
};

// The region of an all_gather call.
struct RegionConfig {
  int64_t region_offset;
  int64_t region_bytes;
  int64_t site;
  int64_t generation;
};

// A pipelined call (jax_overlap/planning/pipelined.py); its stages come as the
// "stages" attribute.
struct PipelinedConfig {
  int64_t w_kmajor;
  int64_t scaling;            // ScaleMode of x_scale and w_scale
  int64_t fast_accumulation;  // GemmTypes::fast_accumulation
  int64_t x_scale_shared;     // pipelined::Operands::x_scale_shared
  int64_t region_offset;
  int64_t region_bytes;
  int64_t site;
  int64_t generation;
};

inline constexpr int kMaxLocalDevices = 64;

// One enqueuer per GPU (docs/protocol.md, "Host threads"). A call with peers
// takes its region's epoch (EpochCounter::next) and binds its CallState with
// plain host writes, right only while no two host threads run such calls'
// execute handlers on one GPU at once. XLA holds to that when each GPU's
// programs are dispatched one at a time (PjRt runs a program of several local
// GPUs on each GPU's own execute thread, and a program of one GPU on the
// thread that called it); two Python threads calling such programs on one GPU
// at once do not. An execute claims its GPU for its length: a second claim
// meanwhile fails, and its call is refused naming both threads. The claim is
// one atomic compare-exchange (acquire) and one store (release), so calls that
// follow each other from different threads also see each other's writes; no
// lock, no allocation.
class EnqueueClaim {
 public:
  explicit EnqueueClaim(int32_t ordinal);
  ~EnqueueClaim();
  EnqueueClaim(const EnqueueClaim&) = delete;
  EnqueueClaim& operator=(const EnqueueClaim&) = delete;

  int32_t ordinal() const { return ordinal_; }
  // Success when this thread holds its GPU; else the error naming `op`, this thread and the one that held it.
  ffi::Error status(const char* op) const;

 private:
  int32_t ordinal_;
  uint64_t thread_;  // this thread (its Linux thread id)
  uint64_t holder_;  // the thread that held the GPU when this one claimed it; 0: none (claimed)
};

// FFI state of one custom call in one executable. Made in the instantiate
// stage. One executable can serve every GPU of the process (one SPMD program),
// so the state binds per device ordinal, on that device's first execute (the
// ordinal is known there); each slot is touched only by its device's execute,
// under its EnqueueClaim.
struct CallState {
  static ffi::TypeId id;
  std::vector<int64_t> groups;  // global device ids, groups concatenated, each in rank order
  int world = 1;
  uint64_t region_offset = 0;
  uint64_t region_bytes = 0;
  uint64_t generation = 0;
  uint32_t site = 0;
  std::vector<int64_t> stages;  // pipelined: ring positions per stage
  bool bound[kMaxLocalDevices] = {};
  GroupBinding bindings[kMaxLocalDevices];
};

extern const XLA_FFI_TypeInfo kCallStateTypeInfo;

inline ffi::Error internal_error(const Status& s) { return ffi::Error::Internal(s.message); }

#define JO_FFI_RETURN_IF_ERROR(expr)                                 \
  do {                                                               \
    ::jo::Status jo_ffi_status_ = (expr);                            \
    if (!jo_ffi_status_.ok()) return ::jo::internal_error(jo_ffi_status_); \
  } while (0)

// Where the call's region is, and which runtime generation placed it.
struct RegionPlacement {
  int64_t offset;
  int64_t bytes;
  int64_t site;  // this call site's number among those sharing the region (kernels/region_layout.h flag_value)
  int64_t generation;
};

ffi::ErrorOr<std::unique_ptr<CallState>> make_call_state(ffi::Span<const int64_t> groups, int64_t world,
                                                          const RegionPlacement& region);

// The binding of `state` on the claimed GPU, made on first use; fails when the
// claim failed (another thread is enqueuing there) or the call was lowered
// before jax_overlap.shutdown() freed its workspace.
ffi::ErrorOr<const GroupBinding*> bind_call(const char* op, CallState* state, const EnqueueClaim& claim);
// The GPU's watchdog record as an error (sticky until clear_errors()), or success.
ffi::Error recorded_error(const Workspace& ws);
// bind_call, and an error when this GPU's watchdog fired earlier (recorded_error).
ffi::ErrorOr<const GroupBinding*> prepare_call(const char* op, CallState* state, const EnqueueClaim& claim);

// XLA's data type of each DType.
ffi::DataType ffi_data_type(DType t);
// The DType of an XLA data type; nullopt for a type no DType is.
std::optional<DType> dtype_of(ffi::DataType t);
// An XLA data type as jax names it ("float32", ...), for messages.
std::string data_type_name(ffi::DataType t);

// "[d0, d1, ...]" for error messages.
std::string dims_str(ffi::Span<const int64_t> dims);

// Product of all but the last two dimensions (1 for rank 2).
int64_t leading_batch(ffi::Span<const int64_t> dims);

// A GEMM call's operands as its handler receives them. The scales are
// absent (nullptr) from targets that take no float8 operands (the fused
// kernels'), and empty (f32[0]) in a 16-bit call of a target that does.
struct GemmArgs {
  const ffi::AnyBuffer& x;
  const ffi::AnyBuffer& w;
  const ffi::AnyBuffer& bias;
  const ffi::AnyBuffer* x_scale;
  const ffi::AnyBuffer* w_scale;
};

// The checks every GEMM handler shares, naming `op` in their errors: x is
// [..., m, k], w is 2-D and contracts with x ([k, n], or [n, k] with
// w_kmajor); bias is empty or [n]; k and n are whole 16-byte vectors of x.
// Types: 16-bit x with w, bias, y and the `like_x` results in its dtype, the
// scales (if taken) empty, `scaling` ScaleMode::kNone; or float8 x and w (not
// both e5m2, OCP or fnuz alike), y bfloat16, float16 or float32, the bias y's
// dtype or float32, the `like_x` results (gathered x) in x's dtype, and the
// scales as `scaling` (the call's attribute, a ScaleMode) says: kTensor, each
// f32[1]; kBlock (core/block_scales.h; types.blocks), x_scale batch * m * k/128
// floats, w_scale n/128 * round_up(k/128, 4), k and n multiples of 128, w
// K-major. fast_accumulation (GemmTypes): tensor-scaled float8 only. The
// call's problem: x's leading dims as its batch, m as its rows, dense, no
// alignment.
ffi::ErrorOr<GemmProblem> check_gemm(const char* op, const GemmArgs& args, const ffi::AnyBuffer& y,
                                     std::initializer_list<const ffi::AnyBuffer*> like_x, bool w_kmajor,
                                     int64_t scaling, bool fast_accumulation = false);

// The fused kernels' operands of a checked call, with its tile and movers.
GemmOperands fused_operands(const GemmProblem& problem, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                            const ffi::AnyBuffer& bias, int64_t tile, int64_t comm_workgroups);

// "jax_overlap <op>: <what> for <name>: expected <expected>, got <got>" (jax's CheckShape form).
ffi::Error invalid_argument(const char* op, const char* name, const std::string& expected, const std::string& got);
// Checks that `buffer` holds `elements` elements.
ffi::Error check_elements(const char* op, const char* name, const ffi::AnyBuffer& buffer, int64_t elements);

// The launch context of one call of `state` on its binding; takes the call's epoch.
CallContext call_context(const CallState& state, const GroupBinding& g, OpKind op);

// After a launch: the launch status, and in sync mode (debugging) the
// watchdog verdict of this very call.
ffi::Error finish_launch(hipError_t launched, const Workspace& ws, hipStream_t stream, const char* op);
ffi::Error finish_launch(const Status& enqueued, const Workspace& ws, hipStream_t stream, const char* op);

// A group-of-one call: its checked problem and operands (check_gemm, plus
// `out` being [..., m, n]), its launch context on this GPU and its stream-K tail scratch
// (an XLA result of config.tail_slots slots, used as it comes: the kernel
// clears every flag it sets, gemm/tile_scheduler.h). Such a call has no peer or
// epoch, but its launch holds this GPU's device state (abort flag, error
// record, trace buffer), which jax_overlap.shutdown() frees: its targets are
// not command-buffer compatible (a replayed graph would skip this check and
// read freed memory), and a call lowered under another runtime generation
// fails here, as prepare_call does. Its context carries this GPU's watchdog:
// a stream-K head that waits past it for its tail (a bug of the launch, never
// a peer) is recorded as a peer's timeout is.
struct LocalCall {
  GemmProblem problem;
  GemmOperands op;
  CallContext ctx;
  TailScratch tail;
  const Workspace* ws;
};
ffi::ErrorOr<LocalCall> local_call(const char* op, OpKind kind, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                   const ffi::AnyBuffer& bias, const ffi::AnyBuffer& out, ffi::AnyBuffer scratch,
                                   const FusedConfig& config, int32_t ordinal);

// After a group-of-one launch: its status, and its output poisoned (NaN) on
// the GPU when this GPU's watchdog has fired (a stalled stream-K head, or an
// earlier timeout).
ffi::Error finish_local_launch(hipError_t launched, const LocalCall& lc, ffi::AnyBuffer out, hipStream_t stream,
                               const char* op);

}  // namespace jo

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jo::FusedConfig, ::xla::ffi::StructMember<int64_t>("tile"),
                                      ::xla::ffi::StructMember<int64_t>("comm_workgroups"),
                                      ::xla::ffi::StructMember<int64_t>("chunk_k"),
                                      ::xla::ffi::StructMember<int64_t>("w_kmajor"),
                                      ::xla::ffi::StructMember<int64_t>("region_offset"),
                                      ::xla::ffi::StructMember<int64_t>("region_bytes"),
                                      ::xla::ffi::StructMember<int64_t>("site"),
                                      ::xla::ffi::StructMember<int64_t>("tail_slots"),
                                      ::xla::ffi::StructMember<int64_t>("generation"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jo::RegionConfig, ::xla::ffi::StructMember<int64_t>("region_offset"),
                                      ::xla::ffi::StructMember<int64_t>("region_bytes"),
                                      ::xla::ffi::StructMember<int64_t>("site"),
                                      ::xla::ffi::StructMember<int64_t>("generation"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jo::PipelinedConfig, ::xla::ffi::StructMember<int64_t>("w_kmajor"),
                                      ::xla::ffi::StructMember<int64_t>("scaling"),
                                      ::xla::ffi::StructMember<int64_t>("fast_accumulation"),
                                      ::xla::ffi::StructMember<int64_t>("x_scale_shared"),
                                      ::xla::ffi::StructMember<int64_t>("region_offset"),
                                      ::xla::ffi::StructMember<int64_t>("region_bytes"),
                                      ::xla::ffi::StructMember<int64_t>("site"),
                                      ::xla::ffi::StructMember<int64_t>("generation"));

namespace jo {

// The FFI signature of both ops' group-of-one targets (handlers.h).
inline auto local_gemm_binding() {
  return ::xla::ffi::Ffi::Bind()
      .Ctx<::xla::ffi::PlatformStream<hipStream_t>>()
      .Ctx<::xla::ffi::DeviceOrdinal>()
      .Arg<::xla::ffi::AnyBuffer>()  // x [..., m, k]
      .Arg<::xla::ffi::AnyBuffer>()  // w [k, n] or [n, k]
      .Arg<::xla::ffi::AnyBuffer>()  // bias [n], or [0] for none
      .Ret<::xla::ffi::AnyBuffer>()  // y [..., m, n]
      .Ret<::xla::ffi::AnyBuffer>()  // stream-K tail scratch, u8 [tail_scratch_bytes]
      .Attr<FusedConfig>("config");
}

}  // namespace jo
