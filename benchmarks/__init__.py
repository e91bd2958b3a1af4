"""Benchmark, demo and report code (outside the library; used by experiments/ and colab/)."""
