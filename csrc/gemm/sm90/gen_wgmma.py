"""Writes wgmma.h beside this file (or to the path given): python3 csrc/gemm/sm90/gen_wgmma.py [OUT]."""
import pathlib
import sys

# (N, PTX input type, K of one instruction). N = 224 tiles N = 3584 exactly
# (16 tiles): the tile width the bench sweeps against wave quantization.
SHAPES = [(256, 'bf16', 16), (224, 'bf16', 16), (128, 'bf16', 16), (256, 'e4m3', 32), (224, 'e4m3', 32),
          (128, 'e4m3', 32)]

HEAD = '''// wgmma.mma_async wrappers (sm_90a), written by gen_wgmma.py: the
// accumulator of one m64nN tile is N/2 fp32 registers per thread of the
// warpgroup, each an asm operand. Both operands come from shared memory through
// descriptors (gemm/sm90/ptx.h); scale_d = 0 overwrites the accumulator.
#pragma once

#include <cstdint>

namespace jo::gemm::sm90 {
'''


def chunks(items, n):
  return [items[i:i + n] for i in range(0, len(items), n)]


def wrapper(n, ty, k):
  r = n // 2
  regs = chunks([f'%{i}' for i in range(r)], 16)
  reg_lines = '\n'.join(f'      "{", ".join(c)}{"," if i + 1 < len(regs) else ""}"' for i, c in enumerate(regs))
  outs = chunks([f'"+f"(d[{i}])' for i in range(r)], 8)
  out_lines = ',\n'.join('        ' + ', '.join(c) for c in outs)
  trans = ', 0, 0' if ty == 'bf16' else ''  # fp8 wgmma has no transpose immediates
  return f'''
__device__ __forceinline__ void wgmma_m64n{n}k{k}_{ty}(float (&d)[{r}], uint64_t desc_a, uint64_t desc_b,
                                                     int scale_d) {{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n"
      "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ty}.{ty} {{"
{reg_lines}
      "}}, %{r}, %{r + 1}, p, 1, 1{trans};\\n}}\\n"
      :
{out_lines}
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#else
  __trap();  // wgmma exists only on sm_90a
#endif
}}
'''


body = HEAD + ''.join(wrapper(*s) for s in SHAPES) + '\n}  // namespace jo::gemm::sm90\n'
out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).parent / 'wgmma.h'
out.write_text(body)
