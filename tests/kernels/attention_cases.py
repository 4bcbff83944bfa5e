"""Inputs for the paged-attention tests: NaN-poisoned caches holding random K/V for sequences in shuffled
blocks, queries (optionally strided), and per-dtype tolerances.

Built on the conftest fixtures ``make_cache`` and ``random_block_tables`` (passed in: conftest modules are
not importable), so every case also poisons block-table padding with -1 / far out-of-range ids.
"""

from dataclasses import dataclass

import pytest
import torch

from kvlab.device import DEVICE

#: (atol, rtol) per dtype: the kernels accumulate in fp32 like the reference, but fp16/bf16 round p before
#: the P @ V product and round the output.
F32, F16 = torch.float32, torch.float16

# (num_heads, num_kv_heads, head_dim, block_size, dtype, cache layout): GQA groups 1, 4 and 8, head dims incl. 80.
CONFIGS = [
    pytest.param(2, 2, 64, 16, F32, "contiguous", id="mha-d64-b16-fp32"),
    pytest.param(8, 2, 80, 8, F32, "padded", id="gqa4-d80-b8-fp32"),
    pytest.param(8, 1, 128, 32, F16, "kv_major", id="gqa8-d128-b32-fp16"),
    pytest.param(4, 1, 256, 16, F16, "contiguous", id="gqa4-d256-b16-fp16"),
    pytest.param(16, 2, 80, 16, F16, "padded", id="gqa8-d80-b16-fp16"),
]

# Every block size CONFIGS leaves out (1, 2, 4, 64, 128) and head dims at and between the ends of the supported
# range (16 = the smallest tl.dot tile; 17, 48, 200 and 255 run on padded, masked tiles of 32, 64 and 256), with
# odd GQA ratios. Same columns as CONFIGS; few KV heads, since the interpreter's cost grows with the programs.
GEOMETRIES = [
    pytest.param(2, 1, 16, 1, F32, "kv_major", id="gqa2-d16-b1-fp32"),
    pytest.param(3, 1, 17, 2, F16, "padded", id="gqa3-d17-b2-fp16"),
    pytest.param(6, 2, 48, 4, F32, "contiguous", id="gqa3-d48-b4-fp32"),
    pytest.param(2, 1, 200, 64, F16, "kv_major", id="gqa2-d200-b64-fp16"),
    pytest.param(4, 1, 255, 128, F32, "padded", id="gqa4-d255-b128-fp32"),
    pytest.param(1, 1, 16, 128, F16, "contiguous", id="mha-d16-b128-fp16"),
]

TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@dataclass
class PagedCase:
    query: torch.Tensor          # [num_query_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor       # [num_blocks, 2, block_size, num_kv_heads, head_dim], unused slots NaN
    block_tables: torch.Tensor   # int32 [num_seqs, width], padding -1 or out of range
    seq_lens: torch.Tensor       # int32 [num_seqs]
    cu_query_lens: torch.Tensor  # int32 [num_seqs + 1]

    def args(self):
        return self.query, self.kv_cache, self.block_tables, self.seq_lens


def build_case(make_cache, random_block_tables, *, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
               dtype, q_lens=None, layout="contiguous", strided_query=False, spare_blocks=3):
    """A cache with ``spare_blocks`` never-used (all-NaN) blocks besides the sequences' own, and the
    queries: one per sequence for decode (``q_lens=None``), else ``q_lens[s]`` newest tokens of sequence s.
    ``strided_query`` slices the query out of a wider buffer, so its token and head strides are unusual."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + spare_blocks
    kv_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, layout)
    block_tables, seq_lens_t = random_block_tables(seq_lens, block_size, num_blocks)
    for s, seq_len in enumerate(seq_lens):  # every used slot gets fresh random K and V, the rest stays NaN
        positions = torch.arange(seq_len, device=DEVICE)
        blocks = block_tables[s].long()[positions // block_size]
        offsets = positions % block_size
        kv_cache[blocks, 0, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, device=DEVICE).to(dtype)
        kv_cache[blocks, 1, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    q_lens = [1] * len(seq_lens) if q_lens is None else q_lens
    num_tokens = sum(q_lens)
    if strided_query:
        query = torch.randn(num_tokens, num_heads + 1, head_dim + 5, device=DEVICE).to(dtype)[:, 1:, :head_dim]
    else:
        query = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE).to(dtype)
    cu_query_lens = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    return PagedCase(query, kv_cache, block_tables, seq_lens_t, cu_query_lens)


def strided_block_tables(block_tables):
    """The same table as a view with column stride 2 (the other columns hold junk ids)."""
    wide = torch.full((block_tables.shape[0], 2 * block_tables.shape[1]), -7, dtype=torch.int32, device=DEVICE)
    wide[:, ::2] = block_tables
    return wide[:, ::2]


def assert_close(actual, expected):
    """Finite everywhere (no NaN leaked from poisoned memory) and within the dtype's tolerance."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.isfinite(actual).all(), "NaN/inf in the kernel output: poisoned memory was read"
    atol, rtol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
