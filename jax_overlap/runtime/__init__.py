"""The runtime: the machine a process runs on and what jax_overlap sets up on it (the bottom layer).

  native.py      the compiled extension this installation has, and build_info()
  backend.py     the machine as one object (native module, GPUs, host, state): backend.current()
  settings.py    the environment settings, each checked in one place
  workspace.py   device states, the symmetric workspace, peers, regions, call sites, error records, lifecycle
  processes.py   the steps processes take together (the jax.distributed key-value store)
  errors.py      the runtime's errors
"""
