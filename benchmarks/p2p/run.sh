#!/usr/bin/env bash
# Builds and runs the peer-to-peer microbenchmark (NVIDIA, 2+ GPUs).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-/tmp/jo_p2p_bench}
nvcc -O3 -std=c++17 -arch=sm_90 -I"$root/csrc" -DJAX_OVERLAP_CUDA=1 "$here/bench.cu" -o "$out"
"$out"
