"""Benchmarks: scripts that print numbers (``python -m kvlab.bench blocks|kernels|engine``, or
``kvlab bench ...``), never timed tests."""
