"""Scenarios of tests/gpu/multiprocess.py: what each worker process of one jax.distributed job runs.

Each scenario module defines
  ENV                   environment variables its workers set before jax starts
  WORLDS                world sizes it runs at: None for the --worlds list, else a fixed tuple
  required(rank, world) the checks a worker must report (a crash or a hang after some is a failure)
  returncode(rank, world) the exit code a worker must end with
  run(ctx)              the worker's body (common.Ctx: rank, world, mesh, check, shard, ...)
and may define verdict(result) for checks the parent makes on a worker's stderr.
"""

from scenarios import abandon, abort, agree, copy_paths, fp8, fp8_blocks, main, overwrite, threads, wrap

SCENARIOS = {"main": main, "abort": abort, "agree": agree, "copy_paths": copy_paths, "overwrite": overwrite,
             "abandon": abandon, "wrap": wrap, "fp8": fp8, "fp8_blocks": fp8_blocks, "threads": threads}
