// Makes a GPU current for a scope and restores the device that was current
// before when the scope ends: the one way host code changes devices.
#pragma once

#include "platform/status.h"

namespace jo {

class DeviceScope {
 public:
  // Reads the current device, then makes `ordinal` current; status() says
  // whether both worked. When the current device cannot be read, nothing is
  // changed (there would be nothing to restore).
  explicit DeviceScope(int ordinal) {
    status_ = hipGetDevice(&previous_);
    if (status_ != hipSuccess) {
      previous_ = -1;
      return;
    }
    status_ = hipSetDevice(ordinal);
  }
  ~DeviceScope() {
    if (previous_ >= 0) (void)hipSetDevice(previous_);  // teardown: errors have nowhere to go
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  hipError_t status() const { return status_; }

  // Restores the previous device now, for callers that report a failure to.
  Status restore() {
    const int previous = previous_;
    previous_ = -1;
    if (previous >= 0) JO_RETURN_IF_HIP_ERROR(hipSetDevice(previous));
    return {};
  }

 private:
  int previous_ = -1;
  hipError_t status_ = hipSuccess;
};

}  // namespace jo
