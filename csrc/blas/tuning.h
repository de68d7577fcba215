// The GEMM tuning cache on disk (DeviceBlas::tune reads and writes it): one
// text file per GPU model and library build in the cache directory, like
// XLA's autotuning cache but keyed by the library's version too (a choice is
// an algorithm's bytes, which another library build may not run). Format:
//   jax_overlap gemm algorithms 1
//   library <name> <version> <file>
//   device <name> <arch> sms <count>
//   driver <version>
//   <problem_id> <algorithm bytes, hex> <heuristic index> <us> <heuristic first's us>
// (one line per problem; problem_id: blas/gemm.h). The file's name is a hash of
// the header, so that models and builds never share one. A file whose header
// differs, or with any line that does not parse, is ignored whole (and
// rewritten at the next tuning); a choice read from it is used only when this
// GPU's heuristic lists its algorithm for the problem. Written to a temporary
// file and renamed, so a reader never sees half a file; with several
// processes, the last writer's file (its entries merged with what it read
// just before) wins.
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

// The header lines (without their final newline) of GPU `ordinal`'s cache file.
Status cache_header(int ordinal, std::string* header);
// The file in `dir` for `header`.
std::string cache_path(const std::string& dir, const std::string& header);
// The entries of the file at `path`: empty when there is none; when its header is not `header` or a line
// does not parse (or fault "gemm_cache_corrupt" is on), empty with *ignored saying why.
CacheEntries read_cache(const std::string& path, const std::string& header, std::string* ignored);
// Writes `entries` under `header` to `path` (the directory made if missing), through a temporary file.
Status write_cache(const std::string& path, const std::string& header, const CacheEntries& entries);

// Bytes as hex, and back (false for text that is not `bytes` bytes of hex).
std::string to_hex(const void* data, size_t bytes);
bool from_hex(const std::string& text, void* data, size_t bytes);

}  // namespace jo::blas
