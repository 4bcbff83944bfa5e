"""Paged attention in plain torch, batched: the engine's fast path where there is no CUDA.

Same cache contract, arguments, checks and results as the Triton launchers (``reshape_and_cache``,
``paged_attention_decode``, ``paged_prefill``), but each call is a handful of batched torch ops instead of
one interpreted program per tile. It differs from ``kvlab.kernels.reference``, the tests' oracle, which
loops over sequences to be easy to read; this module is checked against it.

How a step runs (shapes: S sequences, T query tokens, Q = longest query, L = longest visible context):
  write    one indexed store puts the new tokens' K/V ``[T, H_kv, D]`` in their slots (slot -1 is skipped);
           where they go is checked and worked out once per step (``plan_cache_write``).
  plan     once per step (the same for every layer, so the engine builds it once): where K and V of every
           visible context position ``[S, L]`` are, looked up through the block tables, the mask
           ``[S, 1, Q, L]`` (key padding, bottom-right causal, sliding window) and where each query row goes
           when the batch is padded to Q rows per sequence.
  attend   per layer: one ``index_select`` gathers K and V ``[S, H_kv, L, D]`` (temporaries: no contiguous
           copy of any sequence outlives the call), then ``scaled_dot_product_attention`` in fp32 with GQA.

Unused memory is never read, as in the kernels: a padded key position (past a sequence's end) reads the
sequence's last token, which is always written and inside any window, and is then masked. Gathering the
padding's table entries instead would read stale blocks, and masking the scores alone would not save the
output: NaN in V gives 0 * NaN = NaN in P @ V.

MLA (DeepSeek-V2/V3) caches one latent row per token, ``[num_blocks, block_size, kv_lora_rank + rope_dim]``
(``kvlab.kernels.mla_decode``): ``plan_latent_attention`` plans the same gather and mask over those rows,
and ``latent_attention_torch`` attends with the absorbed queries, the rows as keys and their first
``kv_lora_rank`` features as values (multi-query attention: one latent "head" shared by every query head).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.errors import InvalidArgumentError
from kvlab.kernels._checks import (check_attention_options, check_block_tables, check_cu_query_lens, check_kv_cache,
                                   check_latent_cache, check_latent_query, check_query, check_seq_lens,
                                   check_slot_mapping, check_tensor)
from kvlab.kernels.kv_quant import STORAGE_DTYPES
from kvlab.validation import check_number


def check_cache(kv_cache, name="kv_cache"):
    """``check_kv_cache`` as the kernels apply it, except bf16 on CPU: torch computes it correctly, only the
    Triton interpreter does not. The block sizes and head dims stay the kernels', so a model served here is
    served by the GPU kernels too. A quantized cache (uint8 or fp8, ``kvlab.kernels.kv_quant``) is checked
    for its layout only: its last dim holds bytes of records. Returns ``(num_blocks, block_size, num_kv_heads,
    last dim)``."""
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype in STORAGE_DTYPES:
        return check_kv_cache(kv_cache, name, storage_dtypes=STORAGE_DTYPES, head_dims=range(1, 2**31))
    return check_kv_cache(kv_cache, name, arithmetic=False)


def row_view(kv_cache, lead_dims=3):
    """Every ``[num_kv_heads, head_dim]`` row of the cache (one per block, K/V half and offset) in one view
    ``[R, num_kv_heads, head_dim]``, whatever the cache's strides, for ``index_select``. Row (b, kv, o) is
    ``row_index(kv_cache, b, kv, o)``. Rows may overlap in memory (a head-major block layout): read only.
    ``lead_dims``: the dims that pick a row; 2 for an MLA latent cache (block, offset: rows ``[R, latent_dim]``)."""
    step = _row_step(kv_cache, lead_dims)
    last = sum((n - 1) * s for n, s in zip(kv_cache.shape[:lead_dims], kv_cache.stride()[:lead_dims])) // step
    return kv_cache.as_strided((last + 1, *kv_cache.shape[lead_dims:]), (step, *kv_cache.stride()[lead_dims:]),
                               kv_cache.storage_offset())


def _row_step(kv_cache, lead_dims=3):
    """The largest element count that divides the strides of the dims that pick a row (block, K/V half and
    slot): rows of the view are this far apart."""
    return math.gcd(*kv_cache.stride()[:lead_dims])


def row_index(kv_cache, blocks, kv, offsets):
    """Row of ``row_view(kv_cache)`` holding half ``kv`` (0 = K, 1 = V) of slot (blocks, offsets)."""
    s_block, s_kv, s_slot = kv_cache.stride()[:3]
    return (blocks * s_block + kv * s_kv + offsets * s_slot) // _row_step(kv_cache)


def reshape_and_cache_torch(key, value, kv_cache, slot_mapping):
    """``reshape_and_cache`` in torch: write ``key``/``value [T, H_kv, D]`` into the slots of ``slot_mapping``
    (int64 ``[T]``, -1 = skip). In place; returns ``kv_cache``. Raises InvalidArgumentError as the kernel does."""
    _, _, num_kv_heads, head_dim = check_cache(kv_cache)
    for name, t in (("key", key), ("value", value)):
        check_tensor(t, name, ndim=3, dtypes=(kv_cache.dtype,), device=kv_cache.device)
        if tuple(t.shape) != (key.shape[0], num_kv_heads, head_dim):
            raise InvalidArgumentError(f"{name} has shape {tuple(t.shape)}; key and value must both be "
                                       f"[{key.shape[0]}, {num_kv_heads}, {head_dim}] (tokens, kv heads, head_dim)")
    return write_cache(key, value, kv_cache, plan_cache_write(kv_cache, slot_mapping, key.shape[0]))


@dataclass(frozen=True)
class CacheWrite:
    """Where one step's new tokens go in the cache; shared by every layer of the step."""
    rows: torch.Tensor     # int64 [W]: the tokens written (slot >= 0), of the step's T
    blocks: torch.Tensor   # int64 [W]: each one's block
    offsets: torch.Tensor  # int64 [W]: and its offset in the block


def plan_cache_write(kv_cache, slot_mapping, num_tokens: int) -> CacheWrite:
    """Check ``slot_mapping`` (int64 ``[num_tokens]``, -1 = skip) as ``reshape_and_cache`` does and work out
    where ``write_cache`` puts each token; ``kv_cache``: any layer's (they share a layout)."""
    num_blocks, block_size, _, _ = check_cache(kv_cache)
    return _plan_write(slot_mapping, num_tokens, num_blocks, block_size, kv_cache.device)


def _plan_write(slot_mapping, num_tokens: int, num_blocks: int, block_size: int, device) -> CacheWrite:
    check_slot_mapping(slot_mapping, num_tokens, num_blocks * block_size, device=device)
    rows = (slot_mapping >= 0).nonzero().flatten()
    slots = slot_mapping[rows]
    return CacheWrite(rows, slots // block_size, slots % block_size)


def write_cache(key, value, kv_cache, write: CacheWrite):
    """Put the tokens ``write`` names of ``key``/``value [T, H_kv, D]`` in their slots (no check, no host read).
    Indexing the 5-D cache itself (not row_view, which may overlap) writes into any layout. Returns kv_cache."""
    kv_cache[write.blocks, :, write.offsets] = torch.stack([key[write.rows], value[write.rows]], 1)
    return kv_cache


@dataclass(frozen=True)
class PagedPlan:
    """Where one step's contexts are, padded to a batch; shared by every layer of the step."""
    kv_rows: torch.Tensor            # int64 [2 * S * L]: row_view rows of K, then V, of context position j
                                     # of sequence s (at s * L + j); an MLA latent cache: [S * L], its rows
    cache_strides: tuple             # the strides kv_rows were computed for (every layer's cache has them)
    mask: torch.Tensor               # bool [S, 1, Q, L]: query row t of sequence s sees key j
    query_rows: torch.Tensor | None  # int64 [S * Q]: the query row each padded row copies; None: already [S, Q]
    out_rows: torch.Tensor | None    # int64 [T]: the padded row holding each query token; None: the same order
    num_seqs: int
    query_len: int                   # Q
    context_len: int                 # L
    num_tokens: int                  # T


def plan_paged_attention(kv_cache, block_tables, seq_lens, cu_query_lens, num_tokens: int,
                         sliding_window=None) -> PagedPlan:
    """Check the step's tables as the kernels' launchers do, then work out what ``paged_attention_torch``
    gathers and masks for ``num_tokens`` query rows. Sequence s owns rows ``cu_query_lens[s]:cu_query_lens[s + 1]``,
    its newest tokens (bottom-right aligned); ``kv_cache`` (any layer's) gives the block size and count."""
    num_blocks, block_size, _, _ = check_cache(kv_cache)
    blocks, offsets, contexts = _plan_contexts(block_tables, seq_lens, cu_query_lens, num_tokens, sliding_window,
                                               num_blocks, block_size, kv_cache.device)
    kv_rows = torch.cat([row_index(kv_cache, blocks, kv, offsets) for kv in (0, 1)])
    return PagedPlan(kv_rows, kv_cache.stride(), **contexts)


def _plan_contexts(block_tables, seq_lens, cu_query_lens, num_tokens: int, sliding_window, num_blocks: int,
                   block_size: int, device):
    """The checks and the cache-independent part of a plan: the block and offset of every gathered context
    position ``[S * L]`` (sequence s's position j at s * L + j), and the plan's other fields."""
    _, sliding_window, _ = check_attention_options(sliding_window=sliding_window)
    check_tensor(seq_lens, "seq_lens", ndim=1)
    num_seqs = seq_lens.shape[0]
    check_seq_lens(seq_lens, num_seqs, device=device, min_len=1)
    check_block_tables(block_tables, num_seqs, num_blocks, seq_lens, block_size)
    check_cu_query_lens(cu_query_lens, num_seqs, num_tokens, seq_lens)

    lens = seq_lens.long()
    q_lens = (cu_query_lens[1:] - cu_query_lens[:-1]).long()
    first_query = lens - q_lens                                       # [S] position of each first new token
    kv_lo = (torch.zeros_like(lens) if sliding_window is None
             else (first_query - sliding_window + 1).clamp(min=0))  # [S] the oldest key any query sees
    query_len, context_len = (torch.stack([q_lens.max(), (lens - kv_lo).max()]).tolist() if num_seqs else (0, 0))
    last = lens[:, None] - 1                                          # [S, 1]
    pos = kv_lo[:, None] + torch.arange(context_len, device=lens.device)  # [S, L] absolute key positions
    key_ok = pos < lens[:, None]
    read = torch.where(key_ok, pos, last)                             # padding reads the last (written) token
    blocks = block_tables.long().gather(1, read // block_size).flatten()
    offsets = (read % block_size).flatten()

    t = torch.arange(query_len, device=lens.device)
    query_ok = t < q_lens[:, None]                                    # [S, Q]
    q_pos = torch.where(query_ok, first_query[:, None] + t, last)     # padded rows pose as the last token,
    visible = key_ok[:, None, :] & (pos[:, None, :] <= q_pos[:, :, None])  # so no row sees nothing
    if sliding_window is not None:
        visible &= q_pos[:, :, None] - pos[:, None, :] < sliding_window
    query_rows = out_rows = None
    if num_tokens != num_seqs * query_len:                            # unequal lengths: pad and unpad
        query_rows = torch.where(query_ok, cu_query_lens[:-1].long()[:, None] + t, 0).flatten()
        out_rows = query_ok.flatten().nonzero().flatten()
    return blocks, offsets, dict(mask=visible[:, None], query_rows=query_rows, out_rows=out_rows, num_seqs=num_seqs,
                                 query_len=query_len, context_len=context_len, num_tokens=num_tokens)


def check_plan(query, kv_cache, plan: PagedPlan) -> None:
    """``plan`` must be the one made for this many query rows and this cache's strides."""
    if query.shape[0] != plan.num_tokens or kv_cache.stride() != plan.cache_strides:
        raise InvalidArgumentError(
            f"the plan was made for {plan.num_tokens} query rows and a cache with strides {plan.cache_strides}; "
            f"got {query.shape[0]} rows and strides {kv_cache.stride()}")


def paged_attention_torch(query, kv_cache, plan: PagedPlan, scale=None, soft_cap=None):
    """Attention of ``query [T, H, D]`` over the contexts ``plan`` describes, read from ``kv_cache``.
    Returns a new ``[T, H, D]`` tensor in query's dtype (computed in fp32)."""
    check_cache(kv_cache)
    check_query(query, kv_cache)
    scale, _, soft_cap = check_attention_options(scale=scale, soft_cap=soft_cap)
    check_plan(query, kv_cache, plan)
    return paged_attention_torch_unchecked(query, kv_cache, plan, scale, soft_cap)


def paged_attention_torch_unchecked(query, kv_cache, plan: PagedPlan, scale=None, soft_cap=None):
    """``paged_attention_torch`` without its checks, for a model's layers: ``plan_paged_attention`` checked the
    step once (a cache of every layer's layout), and the layer made ``query`` and its options itself, so
    repeating the same checks in every layer would only cost Python time (tens of microseconds a layer)."""
    if plan.num_tokens == 0:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    S, L = plan.num_seqs, plan.context_len
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    kv = row_view(kv_cache).index_select(0, plan.kv_rows).view(2, S, L, num_kv_heads, head_dim)
    k, v = kv.transpose(2, 3).float()                                 # each [S, H_kv, L, D]
    return attend(query, k, v, plan, scale, soft_cap)


def attend(query, k, v, plan: PagedPlan, scale=None, soft_cap=None):
    """The attention of ``paged_attention_torch`` once K and V ``[S, H_kv, L, D]`` (fp32) are gathered; also
    the quantized path's, after decoding (``kvlab.kernels.torch_paged_quant``), and MLA's, whose values are
    narrower than its keys (``[S, 1, L, kv_lora_rank]``): the output has the values' width."""
    num_heads, head_dim, num_kv_heads = query.shape[1], query.shape[2], k.shape[1]
    S, Q = plan.num_seqs, plan.query_len
    q = query if plan.query_rows is None else query.index_select(0, plan.query_rows)
    q = q.reshape(S, Q, num_heads, head_dim).transpose(1, 2).float()  # [S, H, Q, D]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if soft_cap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale, enable_gqa=True)
    else:  # SDPA has no soft cap: the scores are materialised, [S, H, Q, L]
        group = num_heads // num_kv_heads
        scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
        scores = (soft_cap * torch.tanh(scores / soft_cap)).masked_fill(~plan.mask, float("-inf"))
        out = scores.softmax(-1) @ v.repeat_interleave(group, 1)
    out = out.transpose(1, 2).reshape(S * Q, num_heads, v.shape[-1])  # [S * Q, H, D_v]
    if plan.out_rows is not None:
        out = out.index_select(0, plan.out_rows)
    return out.to(query.dtype)


def paged_attention_decode_torch(query, kv_cache, block_tables, seq_lens, scale=None, sliding_window=None,
                                 soft_cap=None):
    """``paged_attention_decode`` in torch: one query per sequence, ``query [S, H, D]`` at position
    seq_len - 1. Same arguments (no ``split_k``: nothing here runs in partitions) and result."""
    check_tensor(query, "query", ndim=3)
    num_seqs = query.shape[0]
    check_seq_lens(seq_lens, num_seqs, device=query.device, min_len=1)
    cu_query_lens = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    plan = plan_paged_attention(kv_cache, block_tables, seq_lens, cu_query_lens, num_seqs, sliding_window)
    return paged_attention_torch(query, kv_cache, plan, scale, soft_cap)


def split_k_partitions(scores, values, part_len: int):
    """Split-K decode's first pass in torch, for one sequence: its keys in partitions of ``part_len`` (the last may
    be shorter), each partition's output normalised over its own keys ``[P, H, D]``, the maximum of its scores
    ``[P, H]`` and its sum of exponentials after that maximum ``[P, H]``, from ``scores [H, n]`` and ``values
    [n, H, D]``. The merge (``split_k_reduce``; the split_k_merge puzzle) weighs them into one softmax."""
    outs, maxima, sums = [], [], []
    for start in range(0, scores.shape[1], part_len):
        part = scores[:, start:start + part_len]
        top = part.max(-1).values                                        # [H]
        weights = (part - top[:, None]).exp()                            # [H, part_len]
        total = weights.sum(-1)                                          # [H]
        outs.append(torch.einsum("hn,nhd->hd", weights / total[:, None], values[start:start + part_len]))
        maxima.append(top)
        sums.append(total)
    return torch.stack(outs), torch.stack(maxima), torch.stack(sums)


def merge_split_k(partial_out, partial_max, partial_sum, num_partitions):
    """Split-K decode's merge: ``out [S, H, D]`` from each sequence's first ``num_partitions[s]`` partitions
    (``partial_out [S, P, H, D]``, ``partial_max`` and ``partial_sum [S, P, H]``, as ``split_k_partitions``
    makes them; the unused ones hold stale values): each partition's output weighed by its sum of exponentials
    rescaled to the largest maximum, so the partitions make one softmax."""
    used = (torch.arange(partial_out.shape[1], device=partial_out.device)[None, :]
            < num_partitions[:, None])[..., None]                                   # [S, P, 1]
    top = partial_max.masked_fill(~used, float("-inf")).amax(1, keepdim=True)     # [S, 1, H]
    weights = torch.where(used, partial_sum * (partial_max - top).exp(), 0.0)     # [S, P, H]
    outs = torch.where(used[..., None], partial_out, 0.0)
    return (weights[..., None] * outs).sum(1) / weights.sum(1)[..., None]


def paged_prefill_torch(query, kv_cache, block_tables, seq_lens, cu_query_lens, scale=None, sliding_window=None,
                        soft_cap=None):
    """``paged_prefill`` in torch: each sequence's new tokens over its whole paged context. Same arguments
    and result."""
    check_tensor(query, "query", ndim=3)
    plan = plan_paged_attention(kv_cache, block_tables, seq_lens, cu_query_lens, query.shape[0], sliding_window)
    return paged_attention_torch(query, kv_cache, plan, scale, soft_cap)


def plan_latent_write(latent_cache, kv_lora_rank: int, slot_mapping, num_tokens: int) -> CacheWrite:
    """``plan_cache_write`` for an MLA latent cache ``[num_blocks, block_size, latent_dim]``."""
    num_blocks, block_size, _ = check_latent_cache(latent_cache, kv_lora_rank, arithmetic=False)
    return _plan_write(slot_mapping, num_tokens, num_blocks, block_size, latent_cache.device)


def write_latent_cache(rows, latent_cache, write: CacheWrite):
    """Put the tokens ``write`` names of ``rows [T, latent_dim]`` (each token's normed compressed KV, then its
    rotated key part) in their slots (no check, no host read). Returns latent_cache."""
    latent_cache[write.blocks, write.offsets] = rows[write.rows]
    return latent_cache


def plan_latent_attention(latent_cache, kv_lora_rank: int, block_tables, seq_lens, cu_query_lens,
                          num_tokens: int) -> PagedPlan:
    """``plan_paged_attention`` for an MLA latent cache: ``kv_rows [S * L]`` are rows of
    ``row_view(latent_cache, lead_dims=2)``, one per context position (a row is both key and value)."""
    num_blocks, block_size, _ = check_latent_cache(latent_cache, kv_lora_rank, arithmetic=False)
    blocks, offsets, contexts = _plan_contexts(block_tables, seq_lens, cu_query_lens, num_tokens, None, num_blocks,
                                               block_size, latent_cache.device)
    s_block, s_slot = latent_cache.stride()[:2]
    rows = (blocks * s_block + offsets * s_slot) // _row_step(latent_cache, lead_dims=2)
    return PagedPlan(rows, latent_cache.stride(), **contexts)


def latent_attention_torch(query, latent_cache, plan: PagedPlan, kv_lora_rank: int, scale: float):
    """MLA attention of the absorbed ``query [T, H, latent_dim]`` over the latent rows ``plan`` describes
    (``plan_latent_attention``): keys are whole rows, values their first ``kv_lora_rank`` features. ``scale``
    is the model's (1/sqrt of its query-key head dim, not of the latent width). Returns a new
    ``[T, H, kv_lora_rank]`` tensor in query's dtype (computed in fp32)."""
    check_latent_cache(latent_cache, kv_lora_rank, arithmetic=False)
    check_latent_query(query, latent_cache)
    check_number("scale", scale, 0, min_open=True)
    check_plan(query, latent_cache, plan)
    return latent_attention_torch_unchecked(query, latent_cache, plan, kv_lora_rank, scale)


def latent_attention_torch_unchecked(query, latent_cache, plan: PagedPlan, kv_lora_rank: int, scale: float):
    """``latent_attention_torch`` without its checks (``plan_latent_attention`` checked the step once)."""
    if plan.num_tokens == 0:
        return query.new_empty(0, query.shape[1], kv_lora_rank)
    rows = row_view(latent_cache, lead_dims=2).index_select(0, plan.kv_rows)
    k = rows.view(plan.num_seqs, 1, plan.context_len, latent_cache.shape[2]).float()  # [S, 1, L, latent_dim]
    return attend(query, k, k[..., :kv_lora_rank], plan, scale)


def mla_decode_torch(query, latent_cache, block_tables, seq_lens, kv_lora_rank: int, scale: float):
    """``kvlab.kernels.mla_decode`` in torch (its twin): one absorbed query per sequence, ``query [S, H,
    latent_dim]`` at position seq_len - 1. Same arguments and result."""
    check_tensor(query, "query", ndim=3)
    num_seqs = query.shape[0]
    check_seq_lens(seq_lens, num_seqs, device=query.device, min_len=1)
    cu_query_lens = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    plan = plan_latent_attention(latent_cache, kv_lora_rank, block_tables, seq_lens, cu_query_lens, num_seqs)
    return latent_attention_torch(query, latent_cache, plan, kv_lora_rank, scale)
