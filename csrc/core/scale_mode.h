// How a GEMM call's float8 operands are scaled, as the call's attributes carry
// it: the handlers check the scales' shapes against the mode instead of
// guessing it from them (a new mode, or a scale of the wrong shape, is then an
// error naming the operand, never another mode). jax_overlap/quantization/scaling.py
// Scaling.code holds the same numbers; the native module exports them as
// SCALE_MODES (the harness module), which a test compares.
#pragma once

#include <cstdint>
#include <string>

namespace jo {

enum class ScaleMode : int64_t {
  kNone = 0,    // 16-bit operands: scales f32[0]
  kTensor = 1,  // one float32 per operand: f32[1] each
  kBlock = 2,   // block scales (core/block_scales.h)
};

inline constexpr ScaleMode kScaleModes[] = {ScaleMode::kNone, ScaleMode::kTensor, ScaleMode::kBlock};

// Python's name of the mode (Scaling.name; "none" for 16-bit operands).
inline constexpr const char* scale_mode_name(ScaleMode m) {
  switch (m) {
    case ScaleMode::kNone: return "none";
    case ScaleMode::kTensor: return "tensor";
    case ScaleMode::kBlock: return "block";
  }
  return "unknown";
}

// The mode of an attribute's value; false for a value that is none.
inline bool scale_mode_of(int64_t value, ScaleMode* out) {
  for (ScaleMode m : kScaleModes)
    if (static_cast<int64_t>(m) == value) {
      *out = m;
      return true;
    }
  return false;
}

// "block (2)", for messages.
inline std::string describe_scale_mode(ScaleMode m) {
  return std::string(scale_mode_name(m)) + " (" + std::to_string(static_cast<int64_t>(m)) + ")";
}

}  // namespace jo
