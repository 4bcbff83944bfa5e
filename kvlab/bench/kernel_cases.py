"""What the kernel benchmark measures (``kvlab.bench.kernels`` runs the grid, ``kvlab.bench.kernel_impls`` builds
each case's implementations): a case, the dtypes and the fixed sizes the grid's cases share."""

from dataclasses import dataclass

import torch

PREFILL_QUERY_LEN = 512
COPY_LAYERS = 32
#: A case's dtype name -> the cache's dtype. fp8 cases (decode, prefill and reshape_and_cache) keep the cache in
#: fp8 with unit scales per KV head and the query, new K/V and output in ``IO_DTYPES`` (fp16).
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
          "fp8_e5m2": torch.float8_e5m2}
FP8 = ("fp8_e4m3", "fp8_e5m2")


def io_dtype(dtype: str) -> torch.dtype:
    """The dtype of a case's query, new K/V and output: the cache's, or fp16 for an fp8 cache."""
    return torch.float16 if dtype in FP8 else DTYPES[dtype]


@dataclass(frozen=True)
class Case:
    kernel: str  # "decode", "prefill", "reshape_and_cache", "copy_blocks", "swap_out" or "swap_in"
    dtype: str   # key of DTYPES (the cache's dtype)
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
