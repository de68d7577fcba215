"""The runtime: the machine a process runs on and what jax_overlap sets up on it (the bottom layer)."""
