"""The torch path on a quantized cache: ``kvlab.kernels.torch_paged``'s plans and masks, with the new
tokens' K/V encoded on write and the gathered context decoded on read (``kvlab.kernels.kv_quant``).

Same plans as the unquantized path (they depend on the cache's shape and strides, not on what a row holds):
a write stores each (token, KV head)'s record, its first half in the K half of the cache and the rest in the
V half; a read gathers both halves of every visible position, joins them into records and decodes them to
fp32 K and V. Unused memory is still never read: padding positions read the sequence's last, written token.
"""

import torch

from kvlab.errors import InvalidArgumentError
from kvlab.kernels._checks import check_attention_options, check_tensor
from kvlab.kernels.kv_quant import KVQuantizer
from kvlab.kernels.torch_paged import (CacheWrite, PagedPlan, attend, check_cache, check_plan, plan_cache_write,
                                       plan_paged_attention, row_view)


def _check(kv_cache, quantizer: KVQuantizer):
    """The cache's shape against the format's (not the scales: ``quantizer.check``, once, by the public
    functions here and by the engine when it makes the quantizers); returns (num_blocks, block_size,
    num_kv_heads)."""
    num_blocks, block_size, num_kv_heads, width = check_cache(kv_cache)
    if kv_cache.dtype != quantizer.storage_dtype or width != quantizer.storage_width:
        raise InvalidArgumentError(
            f"a {quantizer.format} cache for head_dim {quantizer.head_dim} is {quantizer.storage_dtype} with a last "
            f"dim of {quantizer.storage_width}; got {kv_cache.dtype} with {width}")
    return num_blocks, block_size, num_kv_heads


def write_cache_quantized(key, value, kv_cache, write: CacheWrite, quantizer: KVQuantizer):
    """Encode the tokens ``write`` names of ``key``/``value [T, H_kv, D]`` and store them (no check). Returns
    kv_cache."""
    records = quantizer.encode(key[write.rows], value[write.rows])              # [W, H, 2 * width]
    halves = records.unflatten(-1, (2, -1)).transpose(1, 2)                     # [W, 2, H, width]
    kv_cache.view(torch.uint8)[write.blocks, :, write.offsets] = halves
    return kv_cache


def reshape_and_cache_quantized(key, value, kv_cache, slot_mapping, quantizer: KVQuantizer):
    """``reshape_and_cache_torch`` for a quantized cache: checks, then encodes and writes."""
    _, _, num_kv_heads = _check(kv_cache, quantizer)
    quantizer.check(num_kv_heads)
    for name, t in (("key", key), ("value", value)):
        check_tensor(t, name, ndim=3, device=kv_cache.device)
        if tuple(t.shape) != (key.shape[0], num_kv_heads, quantizer.head_dim) or not t.is_floating_point():
            raise InvalidArgumentError(f"{name} must be a float tensor [{key.shape[0]}, {num_kv_heads}, "
                                       f"{quantizer.head_dim}] (tokens, kv heads, head_dim), got {t.dtype} "
                                       f"{tuple(t.shape)}")
    return write_cache_quantized(key, value, kv_cache, plan_cache_write(kv_cache, slot_mapping, key.shape[0]),
                                 quantizer)


def paged_attention_torch_quantized(query, kv_cache, plan: PagedPlan, quantizer: KVQuantizer, scale=None,
                                    soft_cap=None):
    """``paged_attention_torch`` reading a quantized cache: ``query [T, H, D]`` (any float dtype) -> a new
    ``[T, H, D]`` tensor in query's dtype, computed in fp32 on the decoded K and V."""
    _, _, num_kv_heads = _check(kv_cache, quantizer)
    check_tensor(query, "query", ndim=3, device=kv_cache.device)
    num_heads = query.shape[1]
    if query.shape[2] != quantizer.head_dim or num_heads % num_kv_heads or not query.is_floating_point():
        raise InvalidArgumentError(f"query must be a float tensor [tokens, a multiple of {num_kv_heads} heads, "
                                   f"{quantizer.head_dim}], got {query.dtype} {tuple(query.shape)}")
    scale, _, soft_cap = check_attention_options(scale=scale, soft_cap=soft_cap)
    check_plan(query, kv_cache, plan)
    if plan.num_tokens == 0:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    S, L = plan.num_seqs, plan.context_len
    halves = row_view(kv_cache.view(torch.uint8)).index_select(0, plan.kv_rows).view(2, S, L, num_kv_heads, -1)
    k, v = quantizer.decode(torch.cat((halves[0], halves[1]), -1))           # each [S, L, H_kv, D] fp32
    return attend(query, k.transpose(1, 2), v.transpose(1, 2), plan, scale, soft_cap)


def paged_attention_decode_torch_quantized(query, kv_cache, block_tables, seq_lens, quantizer: KVQuantizer,
                                           scale=None, sliding_window=None):
    """Decode (one query per sequence at position seq_len - 1) on a quantized cache: the torch twin of the
    Triton decode kernel's fp8 variant."""
    check_tensor(query, "query", ndim=3)
    num_seqs = query.shape[0]
    cu_query_lens = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    plan = plan_paged_attention(kv_cache, block_tables, seq_lens, cu_query_lens, num_seqs, sliding_window)
    quantizer.check(kv_cache.shape[3])
    return paged_attention_torch_quantized(query, kv_cache, plan, quantizer, scale)
