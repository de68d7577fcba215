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
    JO_RETURN_IF_HIP_ERROR(hipEventCreateWithFlags(&s->pulled, hipEventDisableTiming));
    for (hipEvent_t& e : s->staged) JO_RETURN_IF_HIP_ERROR(hipEventCreateWithFlags(&e, hipEventDisableTiming));
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
  for (hipEvent_t e : staged)
    if (e) (void)hipEventDestroy(e);
  if (pulled) (void)hipEventDestroy(pulled);
  for (hipEvent_t e : finished)
    if (e) (void)hipEventDestroy(e);
  if (fork) (void)hipEventDestroy(fork);
  for (hipStream_t c : compute)
    if (c) (void)hipStreamDestroy(c);
  if (copy) (void)hipStreamDestroy(copy);
}

Status SideStreams::fork_from(hipStream_t origin) {
  JO_RETURN_IF_HIP_ERROR(hipEventRecord(fork, origin));
  JO_RETURN_IF_HIP_ERROR(hipStreamWaitEvent(copy, fork, 0));
  for (hipStream_t c : compute) JO_RETURN_IF_HIP_ERROR(hipStreamWaitEvent(c, fork, 0));
  return {};
}

Status SideStreams::join_into(hipStream_t origin) {
  const hipStream_t sides[3] = {copy, compute[0], compute[1]};
  for (int i = 0; i < 3; ++i) {
    JO_RETURN_IF_HIP_ERROR(hipEventRecord(finished[i], sides[i]));
    JO_RETURN_IF_HIP_ERROR(hipStreamWaitEvent(origin, finished[i], 0));
  }
  return {};
}

Status device_side_streams(int ordinal, SideStreams** out) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::unique_ptr<SideStreams>& streams = r.devices[ordinal];
  if (!streams) JO_RETURN_IF_ERROR(SideStreams::create(ordinal, &streams));
  *out = streams.get();
  return {};
}

void release_side_streams(int ordinal) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.devices.erase(ordinal);
}

}  // namespace jo::pipelined
