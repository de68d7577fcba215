#include "runtime/faults.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>

namespace jo::faults {
namespace {

struct Faults {
  std::mutex mu;
  std::string spec;
  std::map<std::string, std::string> values;  // name -> value ("" when none was given)
  std::atomic<bool> any{false};

  Faults() {
    const char* env = std::getenv("JAX_OVERLAP_FAULTS");
    if (env != nullptr) parse(env);
  }

  void parse(const std::string& text) {  // mu held, or in the constructor
    spec = text;
    values.clear();
    size_t start = 0;
    while (start <= text.size()) {
      const size_t end = std::min(text.find(',', start), text.size());
      const std::string item = text.substr(start, end - start);
      if (!item.empty()) {
        const size_t eq = item.find('=');
        values[item.substr(0, eq)] = eq == std::string::npos ? "" : item.substr(eq + 1);
      }
      start = end + 1;
    }
    any.store(!values.empty(), std::memory_order_release);
  }
};

Faults& instance() {
  static Faults* faults = new Faults();  // never destroyed: handlers may run during interpreter exit
  return *faults;
}

}  // namespace

void set_spec(const std::string& text) {
  Faults& f = instance();
  std::lock_guard<std::mutex> lock(f.mu);
  f.parse(text);
}

std::string spec() {
  Faults& f = instance();
  std::lock_guard<std::mutex> lock(f.mu);
  return f.spec;
}

bool enabled(const char* name) {
  Faults& f = instance();
  if (!f.any.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(f.mu);
  return f.values.count(name) != 0;
}

int64_t value(const char* name, int64_t fallback) {
  Faults& f = instance();
  if (!f.any.load(std::memory_order_acquire)) return fallback;
  std::lock_guard<std::mutex> lock(f.mu);
  auto it = f.values.find(name);
  if (it == f.values.end() || it->second.empty()) return fallback;
  return std::strtoll(it->second.c_str(), nullptr, 10);
}

}  // namespace jo::faults
