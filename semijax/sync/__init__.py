"""Data-parallel synchronization: how replicas combine their gradients (`config.sync`).

sync (lockstep all-reduce, the engine's own step), ssaw (semi-synchronous rounds with adaptive
weights), async (bounded-staleness asynchronous) and local_sgd (local steps, periodic averaging,
optionally DiLoCo's outer Nesterov). Built on `semijax.core`; beside `models` and `balance`.
"""
