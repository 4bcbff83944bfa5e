"""Benchmarks: scripts that print numbers (``python -m kvlab.bench blocks|kernels``), never timed tests."""
