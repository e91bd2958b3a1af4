"""The engine core: mesh, uneven layouts, sharding, the shard_map kernels, the step plan, the
engine, migration, compile counting and emulated stragglers. Imports nothing above it."""
