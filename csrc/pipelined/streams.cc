#include "pipelined/streams.h"

#include <map>

#include "platform/device_scope.h"

namespace jo::pipelined {
namespace {

struct Registry {
  std::mutex mu;
  std::map<int, std::unique_ptr<SideStreams>> devices;  // ordinal -> its side streams
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: handlers may run during interpreter exit
  return *r;
}

}  // namespace

Status SideStreams::create(int ordinal, std::unique_ptr<SideStreams>* out) {
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  std::unique_ptr<SideStreams> s(new SideStreams());
  const Status made = [&]() -> Status {
    int least = 0, greatest = 0;
    JO_RETURN_IF_HIP_ERROR(hipDeviceGetStreamPriorityRange(&least, &greatest));
    JO_RETURN_IF_HIP_ERROR(hipStreamCreateWithPriority(&s->copy, hipStreamNonBlocking, greatest));
    for (hipStream_t& c : s->compute) JO_RETURN_IF_HIP_ERROR(hipStreamCreateWithPriority(&c, hipStreamNonBlocking, least));
    JO_RETURN_IF_HIP_ERROR(hipEventCreateWithFlags(&s->fork, hipEventDisableTiming));
    for (hipEvent_t& e : s->finished) JO_RETURN_IF_HIP_ERROR(hipEventCreateWithFlags(&e, hipEventDisableTiming));
    for (hipEvent_t& e : s->arrived) JO_RETURN_IF_HIP_ERROR(hipEventCreateWithFlags(&e, hipEventDisableTiming));
    return {};
  }();
  JO_RETURN_IF_ERROR(scope.restore());
  JO_RETURN_IF_ERROR(made);
  *out = std::move(s);
  return {};
}

SideStreams::~SideStreams() {
  // Destroyed only when nothing runs on them any more (SimGroup teardown,
  // Runtime::release, each after a device sync); errors have nowhere to go.
  for (hipEvent_t e : arrived)
    if (e) (void)hipEventDestroy(e);
  for (hipEvent_t e : finished)
    if (e) (void)hipEventDestroy(e);
  if (fork) (void)hipEventDestroy(fork);
  if (blas_owner_ != nullptr)
    for (blas::Handle h : blas) blas_owner_->destroy_handle(h);
  for (hipStream_t c : compute)
    if (c) (void)hipStreamDestroy(c);
  if (copy) (void)hipStreamDestroy(copy);
}

Status SideStreams::attach_blas(blas::DeviceBlas& owner) {
  if (has_blas()) return {};
  DeviceScope scope(owner.ordinal());
  JO_RETURN_IF_HIP_ERROR(scope.status());
  blas::Handle made[2] = {};
  Status status = owner.create_handle(&made[0]);
  if (status.ok()) status = owner.create_handle(&made[1]);
  JO_RETURN_IF_ERROR(scope.restore());
  if (!status.ok()) {
    for (blas::Handle h : made) owner.destroy_handle(h);
    return status;
  }
  blas[0] = made[0];
  blas[1] = made[1];
  blas_owner_ = &owner;
  return {};
}

Status SideStreams::wait(hipStream_t waiter, hipEvent_t event) {
  JO_RETURN_IF_HIP_ERROR(hipStreamWaitEvent(waiter, event, 0));
  ++edges.waits;
  return {};
}

Status SideStreams::record(hipEvent_t event, hipStream_t stream) {
  JO_RETURN_IF_HIP_ERROR(hipEventRecord(event, stream));
  ++edges.records;
  return {};
}

Status SideStreams::fork_from(hipStream_t origin, StreamSet used) {
  JO_RETURN_IF_ERROR(record(fork, origin));
  if (used & kCopy) JO_RETURN_IF_ERROR(wait(copy, fork));
  for (int i = 0; i < 2; ++i)
    if (used & (kCompute0 << i)) JO_RETURN_IF_ERROR(wait(compute[i], fork));
  return {};
}

Status SideStreams::join_into(hipStream_t origin, StreamSet used) {
  const hipStream_t sides[3] = {copy, compute[0], compute[1]};
  for (int i = 0; i < 3; ++i) {
    if (!(used & (1u << i))) continue;
    JO_RETURN_IF_ERROR(record(finished[i], sides[i]));
    JO_RETURN_IF_ERROR(wait(origin, finished[i]));
  }
  return {};
}

Status prepare_side_streams(int ordinal) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::unique_ptr<SideStreams>& streams = r.devices[ordinal];
  if (!streams) {
    const Status made = SideStreams::create(ordinal, &streams);
    if (!made.ok()) {
      r.devices.erase(ordinal);
      return made;
    }
  }
  blas::DeviceBlas* blas = nullptr;
  if (!blas::DeviceBlas::get(ordinal, &blas).ok()) return {};  // attached when the vendor BLAS is prepared
  return streams->attach_blas(*blas);
}

Status attach_side_stream_blas(int ordinal) {
  blas::DeviceBlas* blas = nullptr;
  JO_RETURN_IF_ERROR(blas::DeviceBlas::get(ordinal, &blas));
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.devices.find(ordinal);
  if (it == r.devices.end()) return {};  // no side streams yet: prepare_side_streams attaches them
  return it->second->attach_blas(*blas);
}

Status device_side_streams(int ordinal, SideStreams** out) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.devices.find(ordinal);
  if (it == r.devices.end() || !it->second->has_blas())
    return Status{"jax_overlap: GPU " + std::to_string(ordinal) + " has no pipelined side streams" +
                  (it == r.devices.end() ? "" : " with vendor BLAS handles") +
                  ": jax_overlap makes them when it lowers a pipelined call (after jax_overlap.shutdown(), the "
                  "calls lowered before it refuse to run)"};
  *out = it->second.get();
  return {};
}

void release_side_streams(int ordinal) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.devices.erase(ordinal);
}

}  // namespace jo::pipelined
