// The runtime's plain all-gather over the symmetric workspace: the fetcher
// role of ag_matmul on its own. It proves the runtime (peers, epochs,
// watchdog) end to end and is what the runtime tests call.
#pragma once

#include <cstdint>

#include "kernels/params.h"
#include "platform/gpu.h"

namespace jo {

struct AllGatherLaunch {
  const void* x;   // [batch * m, row_bytes]
  void* gathered;  // [batch, world * m, row_bytes]
  int64_t batch, m, row_bytes;
  CallContext ctx;
};

uint64_t all_gather_region_bytes(int world, int64_t rows, int64_t row_bytes);

hipError_t launch_all_gather(const AllGatherLaunch& launch, hipStream_t stream);

}  // namespace jo
