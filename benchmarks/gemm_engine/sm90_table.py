"""The sm90 benchmark's closing tables, from the ROW lines of hopper_bench and cutlass_sm90_bench.

  python3 benchmarks/gemm_engine/sm90_table.py LOG...

reads the tab-separated ROW lines (ROW, process tag, dtype, M, N, K, row name, ms) from the logs and prints, per dtype
and shape, fastest first: every row (the gate's, the raster sweep's, the baselines'), then, last, the short table: one
row per variant (its plain launch) with the baselines. Columns: us, TFLOP/s, x cuBLASLt (its best candidate timed in
the same process, else in the dtype's c1 process: bf16 "cublasLt best", fp8 "cublasLt best (fast accum)"), x CUTLASS
(its sm90 cooperative GEMM at the shape; bf16 only) and, in the short table, the variant's time with the chunk gate's
flags already released.
"""
import collections
import re
import sys

_CUTLASS = 'cutlass 128x256 coop c2x1'
_BASELINE = {'bf16': 'cublasLt best', 'fp8': 'cublasLt best (fast accum)'}
_VARIANT = re.compile(r'^c[12][mn]? (direct|tma) \d+x\d+( d\d)?( pp)?$')


def _read(paths):
  rows = []
  for path in paths:
    with open(path, errors='replace') as f:
      for line in f:
        parts = line.rstrip('\n').split('\t')
        if parts[0] == 'ROW' and len(parts) == 8:
          tag, dtype, m, n, k, name, ms = parts[1:]
          rows.append((tag, dtype, int(m), int(n), int(k), name, float(ms)))
  return rows


def main(paths):
  rows = _read(paths)
  if not rows:
    print('sm90_table: no ROW lines in', ' '.join(paths))
    return 1
  base = {}
  for tag, dtype, m, n, k, name, ms in rows:
    if name == _BASELINE.get(dtype):
      base[(tag, dtype, m, n, k)] = ms
      if tag == f'{dtype}-c1' or (dtype, m, n, k) not in base:
        base[(dtype, m, n, k)] = ms
  cutlass = {(m, n, k): ms for _, _, m, n, k, name, ms in rows if name == _CUTLASS}
  groups = collections.defaultdict(list)
  for row in rows:
    groups[(row[1], row[2], row[3], row[4])].append(row)
  order = sorted(groups, key=lambda g: (g[0], -g[1], g[2], g[3]))

  def ratios(tag, dtype, m, n, k, ms):
    lt = base.get((tag, dtype, m, n, k)) or base.get((dtype, m, n, k))
    cut = cutlass.get((m, n, k)) if dtype == 'bf16' else None
    return (f'{lt / ms:.3f}' if lt else '-', f'{cut / ms:.3f}' if cut else '-')

  print('\nAll rows')
  for dtype, m, n, k in order:
    print(f'\n{dtype} {m} x {n} x {k}')
    print(f'  {"row":<44} {"process":<10} {"us":>8} {"TFLOP/s":>8} {"x cuBLASLt":>10} {"x CUTLASS":>9}')
    for tag, _, _, _, _, name, ms in sorted(groups[(dtype, m, n, k)], key=lambda r: r[6]):
      lt, cut = ratios(tag, dtype, m, n, k, ms)
      print(f'  {name:<44} {tag:<10} {ms * 1e3:8.1f} {2.0 * m * n * k / ms / 1e9:8.1f} {lt:>10} {cut:>9}')

  print('\nPer shape, per variant (plain launch; gate: the same with the chunk flags already released)')
  for dtype, m, n, k in order:
    group = groups[(dtype, m, n, k)]
    gate = {name[:-len(' gate set')]: ms for _, _, _, _, _, name, ms in group if name.endswith(' gate set')}
    short = [r for r in group if _VARIANT.match(r[5]) or r[5] in (_CUTLASS, _BASELINE[dtype])]
    print(f'\n{dtype} {m} x {n} x {k}')
    print(f'  {"variant":<28} {"us":>8} {"TFLOP/s":>8} {"x cuBLASLt":>10} {"x CUTLASS":>9} {"gate us":>8}')
    for tag, _, _, _, _, name, ms in sorted(short, key=lambda r: r[6]):
      if name == _BASELINE[dtype] and tag != f'{dtype}-c1':
        continue  # the other processes' own cuBLASLt times serve their ratios only
      lt, cut = ratios(tag, dtype, m, n, k, ms)
      g = f'{gate[name] * 1e3:.1f}' if name in gate else '-'
      print(f'  {name:<28} {ms * 1e3:8.1f} {2.0 * m * n * k / ms / 1e9:8.1f} {lt:>10} {cut:>9} {g:>8}')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
