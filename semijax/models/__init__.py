"""Models built from uneven tensor-parallel blocks."""
