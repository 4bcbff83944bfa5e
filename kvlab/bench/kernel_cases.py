"""What the kernel benchmark measures (``kvlab.bench.kernels`` runs the grid, ``kvlab.bench.kernel_impls`` builds
each case's implementations): a case, the dtypes and the fixed sizes the grid's cases share."""

from dataclasses import dataclass

import torch

PREFILL_QUERY_LEN = 512
COPY_LAYERS = 32
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    kernel: str  # "decode", "prefill", "reshape_and_cache", "copy_blocks", "swap_out" or "swap_in"
    dtype: str   # key of DTYPES
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 128
    block_size: int = 16
    query_len: int = 0  # new tokens per sequence: 0 = 1 for decode, PREFILL_QUERY_LEN for prefill

    def __post_init__(self):
        if self.query_len == 0 and self.kernel in ("decode", "prefill"):
            # resolved here, so that a case equals its CSV row (the dry run shrinks prefill's query)
            object.__setattr__(self, "query_len", 1 if self.kernel == "decode" else PREFILL_QUERY_LEN)
