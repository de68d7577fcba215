// DeviceBlas::tune and install (blas/gemm.h) and the tuning cache on disk (blas/tuning.h).
//
// Timing, as XLA's autotuner does it but in turns: the heuristic's first
// computes the reference product on random operands; every candidate runs on
// the same operands into a poisoned (NaN) output, and one that fails to run or
// lands farther than kTolerance from the reference (the whole output, on the
// GPU) is dropped; the rest are timed in rounds (TimingProtocol), each timing
// sample_us or more of back-to-back GEMMs, every candidate once per round (the GPU's
// clocks drift under sustained GEMMs: turns spread the drift over every
// candidate alike), and compared by their medians. The heuristic's first
// stays unless another is faster by the margin (noise must not flip a choice
// between runs).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "blas/gemm.h"
#include "blas/internal.h"
#include "blas/library.h"
#include "blas/tuning.h"
#include "core/block_scales.h"
#include "kernels/pipeline_kernels.h"
#include "platform/device_scope.h"
#include "runtime/faults.h"

namespace jo::blas {
namespace {

// tune()'s protocol: the clocks a training step runs at. A GPU under sustained GEMMs sits at its power limit,
// where the ranking of the candidates can differ from the first milliseconds' (docs/performance.md).
constexpr double kTuningSampleUs = 1000;
constexpr int kTuningRounds = 3;
constexpr double kTuningWarmupUs = 10000;
// Back-to-back GEMMs in one sample at most (a sample of tiny GEMMs would otherwise time the launches alone).
constexpr int kMaxReps = 4096;
// A candidate whose second run takes this many times the heuristic's first's is not timed further.
constexpr double kSlowerThanFirst = 2.0;
// Outputs are rounded to 16 bits (2^-8 relative at worst) and summed in another order: 2^-5 of the value (and
// of the output's mean magnitude, for values that cancel) is far beyond that, far below a wrong tile.
constexpr float kTolerance = 1.0f / 32;
constexpr const char* kCacheFormat = "jax_overlap gemm algorithms 2";

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Elements a [rows, cols] operand spans with row stride `ld`, `batch` of them `stride` apart.
uint64_t span(int64_t batch, int64_t stride, int64_t rows, int64_t ld, int64_t cols) {
  return static_cast<uint64_t>((batch - 1) * stride + (rows - 1) * ld + cols);
}

// Device buffers, events and a stream, freed at scope exit (after the stream drained).
struct Scratch {
  std::vector<void*> buffers;
  hipStream_t stream = nullptr;
  hipEvent_t start = nullptr, stop = nullptr;
  ~Scratch() {
    if (stream) (void)hipStreamSynchronize(stream);
    for (void* b : buffers) (void)hipFree(b);
    if (start) (void)hipEventDestroy(start);
    if (stop) (void)hipEventDestroy(stop);
    if (stream) (void)hipStreamDestroy(stream);
  }
  // `bytes` at an address whose lowest set bit is `alignment` (16 to 256): the problem's, exactly.
  Status alloc(uint64_t bytes, int alignment, char** out) {
    void* p = nullptr;
    JO_RETURN_IF_HIP_ERROR(hipMalloc(&p, bytes + 256));
    buffers.push_back(p);
    *out = static_cast<char*>(p) + alignment % 256;
    return {};
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The in-memory copy of each cache file this process read, by path (shared by the GPUs of one model).
struct LoadedCaches {
  std::mutex mu;
  std::map<std::string, CacheEntries> files;
  std::map<std::string, std::string> ignored;  // path -> why its content was ignored
};

LoadedCaches& loaded_caches() {
  static LoadedCaches* c = new LoadedCaches();
  return *c;
}

// The fastest timed candidate, unless the heuristic's first is within `margin` of it.
void pick(const std::vector<CandidateTime>& times, double margin, TuneResult* r) {
  size_t best = 0;
  for (size_t i = 0; i < times.size(); ++i) {
    if (times[i].status != "timed") {
      r->dropped += times[i].status == "slow" ? 0 : 1;
      continue;
    }
    ++r->timed;
    if (times[i].us < times[best].us) best = i;
  }
  if (times[best].us > (1.0 - margin) * times[0].us) best = 0;
  r->index = static_cast<int>(best);
  r->us = times[best].us;
  r->first_us = times[0].us;
}

}  // namespace

TimingProtocol tuning_protocol() { return TimingProtocol{kTuningSampleUs, kTuningRounds, kTuningWarmupUs}; }

std::string to_hex(const void* data, size_t bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    out += kDigits[p[i] >> 4];
    out += kDigits[p[i] & 15];
  }
  return out;
}

bool from_hex(const std::string& text, void* data, size_t bytes) {
  if (text.size() != 2 * bytes) return false;
  auto* p = static_cast<unsigned char*>(data);
  const auto digit = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
  };
  for (size_t i = 0; i < bytes; ++i) {
    const int hi = digit(text[2 * i]), lo = digit(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    p[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return true;
}

Status cache_header(int ordinal, std::string* header) {
  DeviceBlas* blas = nullptr;
  JO_RETURN_IF_ERROR(DeviceBlas::get(ordinal, &blas));
  hipDeviceProp_t prop;
  JO_RETURN_IF_HIP_ERROR(hipGetDeviceProperties(&prop, ordinal));
  int driver = 0;
  JO_RETURN_IF_HIP_ERROR(hipDriverGetVersion(&driver));
  const LibraryIdentity library = library_identity(blas->tool_handle());
  *header = std::string(kCacheFormat) + "\nlibrary " + kLibraryName + " " + std::to_string(library.version) + " " +
            library.file + "\ndevice " + prop.name + " " + gpu::arch_name(prop) + " sms " +
            std::to_string(prop.multiProcessorCount) + "\ndriver " + std::to_string(driver);
  return {};
}

std::string cache_path(const std::string& dir, const std::string& header) {
  char name[40];
  std::snprintf(name, sizeof(name), "gemm-%016llx.txt", static_cast<unsigned long long>(fnv1a(header)));
  return (std::filesystem::path(dir) / name).string();
}

namespace {

// The whole file at `path`; false when it cannot be read.
bool read_file(const std::string& path, std::string* out) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  char chunk[4096];
  size_t got = 0;
  out->clear();
  while ((got = std::fread(chunk, 1, sizeof(chunk), f)) > 0) out->append(chunk, got);
  const bool ok = std::ferror(f) == 0;
  std::fclose(f);
  return ok;
}

// `line`'s space-separated fields.
std::vector<std::string> fields_of(const std::string& line) {
  std::vector<std::string> fields;
  for (size_t start = 0; start < line.size();) {
    const size_t end = std::min(line.find(' ', start), line.size());
    if (end > start) fields.push_back(line.substr(start, end - start));
    start = end + 1;
  }
  return fields;
}

bool to_int(const std::string& text, int* out) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (end != text.c_str() + text.size() || v < 0 || v > 1 << 20) return false;
  *out = static_cast<int>(v);
  return true;
}

bool to_double(const std::string& text, double* out) {
  char* end = nullptr;
  *out = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size() && std::isfinite(*out);
}

}  // namespace

// C stdio and strtol/strtod, not iostreams: operator>>(int&) crashed inside the module in a codecvt facet (likely
// the module's hidden copies of libstdc++'s facet ids, which the process's locale does not know).
CacheEntries read_cache(const std::string& path, const std::string& header, std::string* ignored) {
  ignored->clear();
  std::string content;
  if (!read_file(path, &content)) return {};
  // Fault gemm_cache_corrupt: the file reads as corrupt (its lines past the header do not parse).
  if (faults::enabled("gemm_cache_corrupt")) {
    *ignored = path + ": fault gemm_cache_corrupt";
    return {};
  }
  if (content.compare(0, header.size() + 1, header + "\n") != 0) {
    *ignored = path + ": another header (library, device or driver) than this process's";
    return {};
  }
  CacheEntries entries;
  size_t start = header.size() + 1;
  for (int number = 1; start < content.size(); ++number) {
    const size_t end = std::min(content.find('\n', start), content.size());
    const std::string line = content.substr(start, end - start);
    start = end + 1;
    if (line.empty()) continue;
    const std::vector<std::string> f = fields_of(line);
    CacheEntry e;
    GemmProblem problem;
    Algo bytes;
    if (f.size() != 5 || !parse_problem_id(f[0], &problem) || !from_hex(f[1], &bytes, sizeof(bytes)) ||
        !to_int(f[2], &e.index) || !to_double(f[3], &e.us) || !to_double(f[4], &e.first_us)) {
      *ignored = path + ": entry line " + std::to_string(number) + " does not parse";
      return {};
    }
    e.algo = f[1];
    entries[f[0]] = e;
  }
  return entries;
}

Status write_cache(const std::string& path, const std::string& header, const CacheEntries& entries) {
  std::error_code made;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), made);
  if (made) return Status{"jax_overlap: cannot make the GEMM tuning cache's directory for " + path + ": " +
                          made.message()};
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  std::string text = header + "\n";
  char numbers[96];
  for (const auto& [id, e] : entries) {
    std::snprintf(numbers, sizeof(numbers), " %d %.3f %.3f\n", e.index, e.us, e.first_us);
    text += id + " " + e.algo + numbers;
  }
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  const bool written = f != nullptr && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = f != nullptr && std::fclose(f) == 0;
  if (!written || !closed) {
    (void)std::remove(tmp.c_str());
    return Status{"jax_overlap: cannot write the GEMM tuning cache " + tmp};
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    (void)std::remove(tmp.c_str());
    return Status{"jax_overlap: cannot rename " + tmp + " to " + path};
  }
  return {};
}

Status DeviceBlas::time_candidates(GemmPlan& plan, const std::vector<HeuristicResult>& found,
                                   const TimingProtocol& how, std::vector<CandidateTime>* out) {
  // Fault gemm_tuning_fails: the timing cannot run (as when its buffers do not fit the GPU's memory).
  if (faults::enabled("gemm_tuning_fails")) return Status{"jax_overlap: fault gemm_tuning_fails"};
  const GemmProblem& s = plan.problem_;
  const GemmTypes& t = s.types;
  const Api& api = *api_;
  DeviceScope scope(ordinal_);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  Scratch b;
  const uint64_t x_elems = span(s.batch, s.x_batch_stride, s.rows, s.ldx, s.k);
  const uint64_t y_elems = span(s.batch, s.y_batch_stride, s.rows, s.ldy, s.n);
  const uint64_t w_elems = s.w_kmajor ? span(1, 0, s.n, s.ldw, s.k) : span(1, 0, s.k, s.ldw, s.n);
  const uint64_t y_bytes = y_elems * element_bytes(t.out);
  char *x = nullptr, *w = nullptr, *y = nullptr, *want = nullptr, *bias = nullptr, *workspace = nullptr;
  JO_RETURN_IF_ERROR(b.alloc(x_elems * element_bytes(t.x), s.alignment, &x));
  JO_RETURN_IF_ERROR(b.alloc(w_elems * element_bytes(t.w), s.alignment, &w));
  JO_RETURN_IF_ERROR(b.alloc(y_bytes, s.alignment, &y));
  JO_RETURN_IF_ERROR(b.alloc(y_bytes, s.alignment, &want));
  if (s.bias) JO_RETURN_IF_ERROR(b.alloc(s.n * element_bytes(t.bias), s.alignment, &bias));
  JO_RETURN_IF_ERROR(b.alloc(kWorkspaceBytes, 256, &workspace));
  // Scales (16-byte slots): x's, then w's; one each, or block scales (core/block_scales.h).
  const int64_t x_scales = t.blocks ? (x_block_scales(s.rows, s.k) + kScaleSlot - 1) / kScaleSlot * kScaleSlot
                                    : kScaleSlot;
  float* scales = nullptr;
  if (t.scaled) {
    std::vector<float> values(x_scales + (t.blocks ? w_block_scales(s.n, s.k) : 1), 0.5f);
    char* p = nullptr;
    JO_RETURN_IF_ERROR(b.alloc(values.size() * sizeof(float), 256, &p));
    scales = reinterpret_cast<float*>(p);
    JO_RETURN_IF_HIP_ERROR(hipMemcpy(scales, values.data(), values.size() * sizeof(float), hipMemcpyHostToDevice));
  }
  char* stats_memory = nullptr;
  JO_RETURN_IF_ERROR(b.alloc(sizeof(CompareStats), 256, &stats_memory));
  auto* stats = reinterpret_cast<CompareStats*>(stats_memory);
  JO_RETURN_IF_HIP_ERROR(hipStreamCreateWithFlags(&b.stream, hipStreamNonBlocking));
  JO_RETURN_IF_HIP_ERROR(hipEventCreate(&b.start));
  JO_RETURN_IF_HIP_ERROR(hipEventCreate(&b.stop));
  const hipStream_t stream = b.stream;
  JO_RETURN_IF_HIP_ERROR(launch_fill_random(x, x_elems, t.x, 11, stream));
  JO_RETURN_IF_HIP_ERROR(launch_fill_random(w, w_elems, t.w, 12, stream));
  if (s.bias) JO_RETURN_IF_HIP_ERROR(launch_fill_random(bias, s.n, t.bias, 13, stream));

  // The reference, by the heuristic's first through run(), which also sets the descriptor's pointers.
  static const float kOne = 1.f, kZero = 0.f;
  plan.algo_ = found[0].algo;
  const GemmPointers pointers{x, w, bias, t.scaled ? scales : nullptr, t.scaled ? scales + x_scales : nullptr, want};
  JO_RETURN_IF_ERROR(run(plan, pointers, workspace, stream, tool_handle_));
  const auto gemm = [&](size_t i) -> Status {
    JO_RETURN_IF_BLAS_ERROR(api.matmul(tool_handle_, plan.desc_, &kOne, w, plan.a_, x, plan.b_, &kZero, y, plan.d_,
                                       y, plan.d_, &found[i].algo, workspace, kWorkspaceBytes, stream));
    return {};
  };
  const auto timed = [&](size_t i, int reps, double* us) -> Status {
    JO_RETURN_IF_HIP_ERROR(hipEventRecord(b.start, stream));
    for (int rep = 0; rep < reps; ++rep) JO_RETURN_IF_ERROR(gemm(i));
    JO_RETURN_IF_HIP_ERROR(hipEventRecord(b.stop, stream));
    JO_RETURN_IF_HIP_ERROR(hipEventSynchronize(b.stop));
    float ms = 0;
    JO_RETURN_IF_HIP_ERROR(hipEventElapsedTime(&ms, b.start, b.stop));
    *us = ms * 1e3 / reps;
    return {};
  };
  // Each candidate once into poisoned y, checked against the reference, then once timed (a warm run).
  out->assign(found.size(), CandidateTime{});
  std::vector<size_t> kept;
  double first_warm = 0;
  for (size_t i = 0; i < found.size(); ++i) {
    CandidateTime& c = (*out)[i];
    c.index = static_cast<int>(i);
    c.workspace_bytes = found[i].workspace_size;
    c.waves = found[i].waves_count;
    JO_RETURN_IF_HIP_ERROR(hipMemsetAsync(y, nan_fill_byte(t.out), y_bytes, stream));
    JO_RETURN_IF_HIP_ERROR(hipMemsetAsync(stats, 0, sizeof(CompareStats), stream));
    double us = 0;
    CompareStats got{};
    Status ran = gemm(i);
    c.status = ran.ok() ? "wrong" : "failed";
    if (ran.ok()) ran = [&]() -> Status {
      JO_RETURN_IF_HIP_ERROR(launch_compare(y, want, y_elems, t.out, kTolerance, stats, stream));
      JO_RETURN_IF_HIP_ERROR(hipMemcpyAsync(&got, stats, sizeof(got), hipMemcpyDeviceToHost, stream));
      JO_RETURN_IF_HIP_ERROR(hipStreamSynchronize(stream));
      return got.mismatches == 0 ? timed(i, 1, &us) : Status{"wrong"};
    }();
    if (!ran.ok() && i == 0) return Status{"the heuristic's first algorithm failed its own check: " + ran.message};
    if (!ran.ok()) continue;
    if (i == 0) first_warm = us;
    c.status = "slow";
    if (i > 0 && us > kSlowerThanFirst * first_warm) continue;
    c.status = "timed";
    kept.push_back(i);
  }
  const auto reps_for = [&](double us) {
    return std::clamp(static_cast<int>(std::ceil(us / std::max(first_warm, 1.0))), 1, kMaxReps);
  };
  double ignored = 0;
  if (how.warmup_us > 0) JO_RETURN_IF_ERROR(timed(0, reps_for(how.warmup_us), &ignored));
  const int reps = reps_for(how.sample_us);
  std::vector<std::vector<double>> samples(kept.size());
  for (int round = 0; round < how.rounds; ++round)
    for (size_t j = 0; j < kept.size(); ++j) {
      double us = 0;
      JO_RETURN_IF_ERROR(timed(kept[j], reps, &us));
      samples[j].push_back(us);
    }
  for (size_t j = 0; j < kept.size(); ++j) (*out)[kept[j]].us = median(samples[j]);
  return {};
}

Status DeviceBlas::tune(const GemmProblem& s, const TuningOptions& o, TuneResult* r) {
  std::lock_guard<std::mutex> tool(tool_mu_);
  *r = TuneResult{};
  const auto report = [&](const GemmPlan& p) {
    r->choice = to_hex(&p.algo_, sizeof(p.algo_));
    r->source = p.source_;
    r->index = p.index_;
    r->candidates = p.candidates_;
    r->us = p.us_;
    r->first_us = p.first_us_;
  };
  if (o.candidates <= 1) {
    const GemmPlan* p = nullptr;
    JO_RETURN_IF_ERROR(plan(s, &p));
    report(*p);
    r->detail = "tuning is off (one candidate)";
    return {};
  }
  {  // A choice made before (timed, read or installed) stays: callers may hold its plan.
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(s);
    if (it != plans_.end() && it->second != nullptr && it->second->source_ != AlgoSource::kHeuristic) {
      report(*it->second);
      r->detail = "chosen before in this process";
      return {};
    }
  }
  std::unique_ptr<GemmPlan> p;
  JO_RETURN_IF_ERROR(describe_plan(s, &p));
  std::vector<HeuristicResult> found;
  JO_RETURN_IF_ERROR(heuristic(*p, o.candidates, &found));
  if (found.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    plans_.emplace(s, nullptr);
    return Status{std::string("jax_overlap: ") + kLibraryName + " has no algorithm for " + describe(s)};
  }
  r->candidates = static_cast<int>(found.size());
  const std::string id = problem_id(s);
  std::string header, path;
  if (!o.cache_dir.empty()) {
    const Status named = cache_header(ordinal_, &header);
    if (named.ok()) {
      path = cache_path(o.cache_dir, header);
    } else {
      r->detail = "no tuning cache: " + named.message;
    }
  }
  LoadedCaches& caches = loaded_caches();
  if (!path.empty()) {  // a choice on disk, used where this GPU's heuristic lists it
    std::lock_guard<std::mutex> lock(caches.mu);
    if (!caches.files.count(path)) caches.files[path] = read_cache(path, header, &caches.ignored[path]);
    if (!caches.ignored[path].empty()) r->detail = "tuning cache ignored: " + caches.ignored[path];
    auto e = caches.files[path].find(id);
    for (size_t i = 0; e != caches.files[path].end() && i < found.size(); ++i)
      if (to_hex(&found[i].algo, sizeof(Algo)) == e->second.algo) {
        r->source = AlgoSource::kDiskCache;
        r->index = static_cast<int>(i);
        r->us = e->second.us;
        r->first_us = e->second.first_us;
      }
  }
  if (r->source != AlgoSource::kDiskCache) {
    std::vector<CandidateTime> times;
    const Status timed = time_candidates(*p, found, tuning_protocol(), &times);
    if (timed.ok()) {
      pick(times, o.margin, r);
      r->source = AlgoSource::kTimed;
      counts().tuned.fetch_add(1, std::memory_order_relaxed);
    } else {
      r->index = 0;
      r->detail = "timing the candidates failed, the heuristic's first is kept: " + timed.message;
    }
  }
  p->algo_ = found[r->index].algo;
  p->index_ = r->index;
  p->source_ = r->source;
  p->candidates_ = r->candidates;
  p->us_ = r->us;
  p->first_us_ = r->first_us;
  r->choice = to_hex(&p->algo_, sizeof(p->algo_));
  if (r->source == AlgoSource::kTimed && !path.empty()) {
    // Merged with the file as it is now (other processes may have added to it), then written whole.
    std::lock_guard<std::mutex> lock(caches.mu);
    std::string ignored;
    CacheEntries entries = read_cache(path, header, &ignored);
    for (const auto& [key, e] : caches.files[path]) entries.emplace(key, e);
    entries[id] = CacheEntry{r->choice, r->index, r->us, r->first_us};
    const Status written = write_cache(path, header, entries);
    if (written.ok()) caches.files[path] = entries;
    if (!written.ok()) r->detail = "not saved: " + written.message;
  }
  std::lock_guard<std::mutex> lock(mu_);
  replace(std::move(p));
  return {};
}

Status DeviceBlas::candidate_times(const GemmProblem& s, int candidates, const TimingProtocol& how,
                                   std::vector<CandidateTime>* out) {
  std::lock_guard<std::mutex> tool(tool_mu_);
  std::unique_ptr<GemmPlan> p;
  JO_RETURN_IF_ERROR(describe_plan(s, &p));
  std::vector<HeuristicResult> found;
  JO_RETURN_IF_ERROR(heuristic(*p, candidates, &found));
  if (found.empty())
    return Status{std::string("jax_overlap: ") + kLibraryName + " has no algorithm for " + describe(s)};
  return time_candidates(*p, found, how, out);
}

Status DeviceBlas::install(const GemmProblem& s, const std::string& choice, int candidates, bool* accepted) {
  Algo algo{};
  if (!from_hex(choice, &algo, sizeof(algo)))
    return Status{"jax_overlap: install: expected " + std::to_string(2 * sizeof(Algo)) + " hex digits of a " +
                  kLibraryName + " algorithm, got \"" + choice + "\""};
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(s);
    if (it != plans_.end() && it->second != nullptr && to_hex(&it->second->algo_, sizeof(Algo)) == choice) {
      *accepted = true;  // already this GPU's (the GPU that chose it, or installed before)
      return {};
    }
  }
  std::unique_ptr<GemmPlan> p;
  JO_RETURN_IF_ERROR(describe_plan(s, &p));
  std::vector<HeuristicResult> found;
  JO_RETURN_IF_ERROR(heuristic(*p, candidates, &found));
  for (size_t i = 0; i < found.size(); ++i)
    if (to_hex(&found[i].algo, sizeof(Algo)) == choice) {
      p->algo_ = found[i].algo;
      p->index_ = static_cast<int>(i);
      p->source_ = AlgoSource::kInstalled;
      std::lock_guard<std::mutex> lock(mu_);
      replace(std::move(p));
      *accepted = true;
      return {};
    }
  counts().installs_refused.fetch_add(1, std::memory_order_relaxed);
  *accepted = false;
  const GemmPlan* kept = nullptr;
  return plan(s, &kept);
}

}  // namespace jo::blas
