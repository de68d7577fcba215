// Fault injection: the failure paths a healthy GPU never takes (copy-engine
// faults seen on ROCm, a failing graph-capture check, a call that cannot be
// enqueued after its epoch was taken, a reader paused across a peer's
// watchdog) made to run on demand, so that their code runs somewhere and is
// tested. Off unless JAX_OVERLAP_FAULTS names faults ("name[=value],...", read
// once per process) or a test sets them (set_spec, jax_overlap._native.set_faults).
// Each fault's name and meaning is documented where it is checked.
#pragma once

#include <cstdint>
#include <string>

namespace jo::faults {

// Replaces the faults in effect ("" for none).
void set_spec(const std::string& spec);
// The faults in effect, as set.
std::string spec();
// Whether fault `name` is on. Costs one relaxed atomic load when no fault is set (execute handlers ask).
bool enabled(const char* name);
// The value given as name=value (an integer), `fallback` when the fault is off or has no value.
int64_t value(const char* name, int64_t fallback);

}  // namespace jo::faults
