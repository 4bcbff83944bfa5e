"""Triton kernels for the paged KV cache, each with a plain-torch twin in ``kvlab.kernels.reference`` (the
tests' oracle), and a batched torch path for machines without CUDA in ``kvlab.kernels.torch_paged``.

Cache contract: one tensor per layer ``kv_cache[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(K = ``kv_cache[:, 0]``, V = ``kv_cache[:, 1]``); slot = block_id * block_size + offset. MLA models cache one
latent row per token instead, ``latent_cache[num_blocks, block_size, latent_dim]`` (``mla_decode``). (The
engine may give several layers one tensor, a layer of each KV cache group, each at its own group's block ids:
``kvlab.sizing.groups``.)
"""

import kvlab.device  # noqa: F401  (must run before any @triton.jit: selects the interpreter without a GPU)
from kvlab.kernels.cache import (allocate_cpu_cache, allocate_kv_cache, allocate_latent_cache, bytes_per_block,
                                 num_blocks_for_budget)
from kvlab.kernels.copy_blocks import copy_blocks, swap_blocks
from kvlab.kernels.mla_decode import mla_decode
from kvlab.kernels.paged_attention_decode import paged_attention_decode
from kvlab.kernels.paged_prefill import paged_prefill
from kvlab.kernels.reshape_and_cache import reshape_and_cache
from kvlab.kernels.torch_paged import (mla_decode_torch, paged_attention_decode_torch, paged_prefill_torch,
                                       reshape_and_cache_torch)

__all__ = [
    "reshape_and_cache", "paged_attention_decode", "paged_prefill", "copy_blocks", "swap_blocks", "mla_decode",
    "reshape_and_cache_torch", "paged_attention_decode_torch", "paged_prefill_torch", "mla_decode_torch",
    "allocate_kv_cache", "allocate_cpu_cache", "allocate_latent_cache", "num_blocks_for_budget", "bytes_per_block",
]
