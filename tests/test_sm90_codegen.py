"""The sm90 GEMM's generated wgmma wrappers match their generator."""

import pathlib
import subprocess
import sys

_SM90 = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "gemm" / "sm90"


def test_wgmma_header_is_generated(tmp_path):
  out = tmp_path / "wgmma.h"
  subprocess.run([sys.executable, str(_SM90 / "gen_wgmma.py"), str(out)], check=True)
  assert out.read_text() == (_SM90 / "wgmma.h").read_text(), "rerun python3 csrc/gemm/sm90/gen_wgmma.py"


def test_wgmma_operands_cover_the_accumulator():
  text = (_SM90 / "wgmma.h").read_text()
  for n, ty, k in [(256, "bf16", 16), (224, "bf16", 16), (128, "bf16", 16), (256, "e4m3", 32), (224, "e4m3", 32),
                   (128, "e4m3", 32)]:
    head = f"wgmma_m64n{n}k{k}_{ty}(float (&d)[{n // 2}]"
    assert head in text, head
    body = text.split(head, 1)[1].split("#else", 1)[0]
    # N/2 accumulator registers, then the two descriptors and scale-d.
    assert f'"+f"(d[{n // 2 - 1}])' in body and f'"+f"(d[{n // 2}])' not in body
    assert f"setp.ne.b32 p, %{n // 2 + 2}, 0;" in body and f"}}, %{n // 2}, %{n // 2 + 1}, p, 1, 1" in body
