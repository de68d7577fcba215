// Per-launch time of a GEMM benchmark's launches, shared by hopper_bench.cu and cutlass_sm90_bench.cu.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "check.h"

// Per-launch ms of `reps` launches back to back (after 5 untimed), median: sustained load, as chained calls run.
static float time_b2b(const std::function<void()>& f, int reps = 30) {
  for (int i = 0; i < 5; ++i) f();
  std::vector<cudaEvent_t> ev(reps + 1);
  for (auto& e : ev) CHECK(cudaEventCreate(&e));
  CHECK(cudaEventRecord(ev[0]));
  for (int i = 0; i < reps; ++i) {
    f();
    CHECK(cudaEventRecord(ev[i + 1]));
  }
  CHECK(cudaEventSynchronize(ev[reps]));
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) CHECK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
  for (auto& e : ev) CHECK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}
