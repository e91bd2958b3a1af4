"""Processes: joining a `jax.distributed` job, local multi-process launches, CPU contention."""
