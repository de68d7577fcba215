// The GEMM tuning cache on disk (DeviceBlas::tune reads and writes it): one
// text file per GPU model and library build in the cache directory, like
// XLA's autotuning cache but keyed by the library's version too (a choice is
// an algorithm's bytes, which another library build may not run). Format:
//   jax_overlap gemm algorithms 1
//   library <name> <version> <file>
//   device <name> <arch> sms <count>
//   driver <version>
//   <problem_id> <algorithm bytes, hex> <heuristic index> <us> <heuristic first's us>
// The file's name is a hash of the header, so models and builds never share
// one. A file with a line that does not parse is ignored whole; a choice is
// used only where this GPU's heuristic lists it. Written to a temporary file
// and renamed, so a reader never sees half a file; the last writer wins.
#pragma once

#include <map>
#include <string>

#include "platform/status.h"

namespace jo::blas {

struct CacheEntry {
  std::string algo;  // hex
  int index = 0;
  double us = 0, first_us = 0;
};
using CacheEntries = std::map<std::string, CacheEntry>;  // problem_id -> its choice

Status cache_header(int ordinal, std::string* header);
std::string cache_path(const std::string& dir, const std::string& header);
// Empty when there is no file; empty with *ignored saying why when it is refused.
CacheEntries read_cache(const std::string& path, const std::string& header, std::string* ignored);
Status write_cache(const std::string& path, const std::string& header, const CacheEntries& entries);

std::string to_hex(const void* data, size_t bytes);
bool from_hex(const std::string& text, void* data, size_t bytes);

}  // namespace jo::blas
