"""How the pipelined algorithm splits its copies (csrc/pipelined/copy.h): no single copy moves more than
128 MiB (ROCm/rocm-systems #9927), or less under the fault copy_max_bytes=N. The plan needs no GPU; the
copies themselves are in tests/gpu/test_copy_paths.py.
"""

import pytest

import native_testing

harness = native_testing.module()
pytestmark = pytest.mark.skipif(harness is None, reason="needs the native extension")


@pytest.mark.parametrize("width,height,cap", [(16000, 1, 4096), (3120, 6, 4096), (48, 1000, 4096), (5000, 3, 64),
                                              ((128 << 20) + 16, 2, 128 << 20), (100, 7, 20), (7, 3, 1), (0, 3, 64),
                                              (4096, 0, 64), (1 << 20, 64, 128 << 20)])
def test_copy_pieces_cover_every_byte_once_within_the_cap(width, height, cap):
  pieces = harness.copy_pieces(width, height, cap)
  vector_cap = max(16, cap // 16 * 16)
  covered = {row: [] for row in range(height)}
  for row, offset, w, h in pieces:
    assert 0 < w * h <= vector_cap, (row, offset, w, h)
    for r in range(row, row + h):
      covered[r].append((offset, offset + w))
  for row, spans in covered.items():  # in order, each starting where the last ended, up to the width
    ends = [0] + [end for _, end in spans]
    assert [start for start, _ in spans] == ends[:-1] and ends[-1] == width, (row, spans[:4])
  if width == 0 or height == 0:
    assert pieces == []
  elif width <= vector_cap:  # whole rows together, as many as fit
    assert len(pieces) == -(-height // (vector_cap // width)) and all(p[1] == 0 and p[2] == width for p in pieces)
  else:
    assert len(pieces) == height * -(-width // vector_cap)


def test_the_cap_is_128_mib_and_a_fault_only_lowers_it():
  assert harness.MAX_COPY_BYTES == 128 << 20
  try:
    for spec, cap in [("", 128 << 20), ("copy_max_bytes=4096", 4096), ("copy_max_bytes=1073741824", 128 << 20)]:
      harness.set_faults(spec)
      assert harness.max_copy_bytes() == cap, spec
  finally:
    harness.set_faults("")
