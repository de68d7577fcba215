"""Which GPU algorithm takes a call, and with which plan: one decision, from figures measured on the machine.

  problem.py      the planner's question and answer (Problem, Choice, Declined)
  eligibility.py  whether an algorithm can take a call at all; the float8 formats this process's GPUs run
  decision.py     decide(): an explicit algorithm's plan, or auto's fastest candidate
  figures.py      what the models know of the machine (measured GEMM and reduction times, copy rates)
  pipelined.py    the pipelined algorithm's stage planner and cost model
  fused.py        the fused kernels' tile and mover planner and cost model
  agreement.py    choose(): the decision with the workspace it needs, agreed between processes
  tuning.py       the vendor GEMM's algorithm per problem of a pipelined call, timed and agreed
What is op specific is the op's (ops/), passed in as `op`; nothing here branches on an op's name.
"""

from jax_overlap.planning.decision import AUTO_MARGIN, FUSED_ENGINE_RATIO, decide, faster
from jax_overlap.planning.eligibility import MAX_WORLD, eligible, fp8_declined
from jax_overlap.planning.problem import Choice, Declined, Problem

__all__ = ["AUTO_MARGIN", "FUSED_ENGINE_RATIO", "MAX_WORLD", "Choice", "Declined", "Problem", "decide", "eligible",
           "faster", "fp8_declined"]
