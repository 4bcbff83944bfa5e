"""Triton kernels for the paged KV cache (see kvlab/reference.py for the cache contract)."""

import kvlab.device  # noqa: F401  (must run before any @triton.jit: selects the interpreter without a GPU)
