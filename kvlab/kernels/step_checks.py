"""Checking one step's paged metadata once, for every layer that then launches the kernels unchecked.

The public launchers check their arguments on every call, and the value checks read tensors back to the
host: 2 reads for ``reshape_and_cache``, 4 for ``paged_attention_decode``, 8 for ``paged_prefill`` (plus the
sync its tile map costs). A model calls them once per layer with the same slots and tables, so a 28-layer
model would pay 170-300 syncs a step, and no step could be captured as a CUDA graph. An engine calls
``check_paged_step`` once per step instead, then every layer calls the ``*_unchecked`` launchers with what
it returns: the same checks, the same errors, a number of host reads that does not grow with the layers.
(The torch path does the same with ``torch_paged.plan_paged_attention``.)
"""

from dataclasses import dataclass

import torch

from kvlab.errors import InvalidArgumentError
from kvlab.kernels._checks import (FP8_CACHE_DTYPES, check_attention_options, check_block_tables,
                                   check_cu_query_lens, check_kv_cache, check_seq_lens, check_slot_mapping,
                                   check_tensor)
from kvlab.kernels.kivi_paged_attention import kivi_tile_map
from kvlab.kernels.paged_prefill import prefill_tile_map
from kvlab.validation import check_int


@dataclass(frozen=True)
class CheckedStep:
    """What the unchecked launchers need beyond the step's tensors, all known on the host."""
    max_seq_len: int                # the longest seq_lens entry (decode sizes split-K with it)
    tile_map: torch.Tensor | None   # prefill: ``prefill_tile_map``'s int32 [num_query_tiles, 2]; None: decode
    #                                 (a KIVI cache: ``kivi_tile_map``'s, decode too)


def check_paged_step(kv_cache, num_heads: int, slot_mapping, block_tables, seq_lens, cu_query_lens=None, *,
                     max_seq_len: int, sliding_window=None, query_dtype=None, kivi=None) -> CheckedStep:
    """Check, once, what ``reshape_and_cache`` and then ``paged_attention_decode`` (``cu_query_lens`` None:
    one new token per sequence) or ``paged_prefill`` would check on every layer, for a step of
    ``slot_mapping.shape[0]`` new tokens with ``num_heads`` query heads. ``kv_cache``: any layer's cache
    (every layer's has its shape, dtype and strides). ``max_seq_len``: the longest context as the caller
    knows it on the host; a ``seq_lens`` entry above it is refused. ``query_dtype``: the queries' (None: the
    cache's); an fp8 cache needs it, since the prefill tile follows it. The fp8 scales are each layer's own:
    the engine checks them when it makes its quantizers. ``kivi``: a KIVI cache's ``KVQuantizer`` (its bytes
    are read by ``kivi_paged_attention``, written by ``kivi_seal``); the step's tile map is then that kernel's,
    for decode too. Raises InvalidArgumentError as the launchers do."""
    fp8 = isinstance(kv_cache, torch.Tensor) and kv_cache.dtype in FP8_CACHE_DTYPES
    if kivi is not None:
        num_blocks, block_size, _, _ = check_kv_cache(kv_cache, storage_dtypes=(torch.uint8,),
                                                      head_dims=(kivi.storage_width,))
        if query_dtype is None:
            raise InvalidArgumentError(f"a {kivi.format} cache holds codes, not the queries' dtype: pass query_dtype")
    else:
        num_blocks, block_size, _, _ = check_kv_cache(kv_cache, storage_dtypes=FP8_CACHE_DTYPES if fp8 else None)
    if fp8 and query_dtype is None:
        raise InvalidArgumentError(f"an fp8 cache ({kv_cache.dtype}) holds codes, not the queries' dtype: pass "
                                   "query_dtype")
    check_attention_options(sliding_window=sliding_window)
    check_int("max_seq_len", max_seq_len, 0)
    check_tensor(slot_mapping, "slot_mapping", ndim=1)
    check_tensor(seq_lens, "seq_lens", ndim=1)
    num_tokens = slot_mapping.shape[0]
    check_slot_mapping(slot_mapping, num_tokens, num_blocks * block_size, device=kv_cache.device)
    num_seqs = num_tokens if cu_query_lens is None else seq_lens.shape[0]
    check_seq_lens(seq_lens, num_seqs, device=kv_cache.device, min_len=1, max_len=max_seq_len)
    check_block_tables(block_tables, num_seqs, num_blocks, seq_lens, block_size)
    if cu_query_lens is not None:
        check_cu_query_lens(cu_query_lens, num_seqs, num_tokens, seq_lens)
    if kivi is not None:
        return CheckedStep(max_seq_len, kivi_tile_map(num_heads, kv_cache, kivi, cu_query_lens, seq_lens,
                                                      query_dtype))
    if cu_query_lens is None:
        return CheckedStep(max_seq_len, None)
    return CheckedStep(max_seq_len, prefill_tile_map(num_heads, kv_cache, cu_query_lens, seq_lens, query_dtype))
