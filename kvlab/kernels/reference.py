"""Plain-torch versions of every kvlab kernel, written to be read. They are the tests' oracle.

Cache contract (shared with the Triton kernels):
    kv_cache      [num_blocks, 2, block_size, num_kv_heads, head_dim]; K = kv_cache[:, 0], V = kv_cache[:, 1]
    block_tables  int32 [num_seqs, max_blocks_per_seq]; logical block i of sequence s is block_tables[s, i]
    seq_lens      int32 [num_seqs]; tokens of each sequence whose K/V is in the cache
    slot_mapping  int64 [num_tokens]; slot = block_id * block_size + offset, -1 means "skip this token"

Attention is computed in fp32 and cast back to the query's dtype. Query head h reads KV head
h // (num_heads // num_kv_heads) (grouped-query attention). A query at absolute position i sees key
positions j <= i, and with ``sliding_window=W`` only the last W of them (i - j < W). ``soft_cap=c``
squashes every score s into c * tanh(s / c) before the softmax.
"""

import math

import torch


def reshape_and_cache_ref(key, value, kv_cache, slot_mapping):
    """Write each token's K/V ``[num_tokens, num_kv_heads, head_dim]`` into its slot. In place; returns kv_cache."""
    block_size = kv_cache.shape[2]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        kv_cache[block, 0, offset] = key[token]
        kv_cache[block, 1, offset] = value[token]
    return kv_cache


def gather_kv_ref(kv_cache, block_table_row, seq_len):
    """The first ``seq_len`` tokens' K and V of one sequence, each ``[seq_len, num_kv_heads, head_dim]``."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_table_row.to(kv_cache.device).long()[positions // block_size]
    offsets = positions % block_size
    return kv_cache[blocks, 0, offsets], kv_cache[blocks, 1, offsets]


def attention_ref(query, key, value, query_positions, scale=None, sliding_window=None, soft_cap=None):
    """Masked softmax attention of ``query [q_len, num_heads, head_dim]`` over ``key/value [kv_len, num_kv_heads,
    head_dim]`` (key j sits at position j); ``query_positions [q_len]`` are the queries' absolute positions."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // key.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q = query.float().transpose(0, 1)                                     # [H, q_len, D]
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)       # [H, kv_len, D]
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)     # [H, kv_len, D]
    scores = (q @ k.transpose(1, 2)) * scale                              # [H, q_len, kv_len]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    i = query_positions.to(query.device).long()[:, None]
    j = torch.arange(key.shape[0], device=query.device)[None, :]
    visible = j <= i
    if sliding_window is not None:
        visible &= i - j < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v                               # [H, q_len, D]
    return out.transpose(0, 1).to(query.dtype)


def paged_attention_decode_ref(query, kv_cache, block_tables, seq_lens, scale=None, sliding_window=None,
                               soft_cap=None):
    """One new query token per sequence, ``query [num_seqs, num_heads, head_dim]``, at position seq_len - 1."""
    out = torch.empty_like(query)
    for s, seq_len in enumerate(seq_lens.tolist()):
        key, value = gather_kv_ref(kv_cache, block_tables[s], seq_len)
        position = torch.tensor([seq_len - 1])
        out[s] = attention_ref(query[s:s + 1], key, value, position, scale, sliding_window, soft_cap)[0]
    return out


def paged_prefill_ref(query, kv_cache, block_tables, seq_lens, cu_query_lens, scale=None, sliding_window=None,
                      soft_cap=None):
    """Prefill over a cached prefix. Sequence s owns query rows ``cu_query_lens[s]:cu_query_lens[s+1]`` of
    ``query [total_query_tokens, num_heads, head_dim]``: its q_len newest tokens, at positions
    seq_len - q_len ... seq_len - 1 (bottom-right aligned). The cache already holds K/V for all seq_len tokens,
    prefix and new ones alike (an engine writes new K/V with reshape_and_cache before attention reads)."""
    out = torch.empty_like(query)
    starts = cu_query_lens.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        key, value = gather_kv_ref(kv_cache, block_tables[s], seq_len)
        positions = torch.arange(seq_len - (end - start), seq_len)
        out[start:end] = attention_ref(query[start:end], key, value, positions, scale, sliding_window, soft_cap)
    return out


def mla_decode_ref(query, latent_cache, block_tables, seq_lens, kv_lora_rank, scale):
    """MLA decode over a latent cache ``[num_blocks, block_size, latent_dim]``: each sequence's absorbed query
    ``[num_heads, latent_dim]`` attends to its rows as keys (one latent head shared by all query heads) and to
    their first ``kv_lora_rank`` features as values. Returns ``[num_seqs, num_heads, kv_lora_rank]``."""
    out = query.new_empty(query.shape[0], query.shape[1], kv_lora_rank)
    block_size = latent_cache.shape[1]
    for s, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len, device=latent_cache.device)
        rows = latent_cache[block_tables[s].to(latent_cache.device).long()[positions // block_size],
                            positions % block_size][:, None]              # [seq_len, 1, latent_dim]
        out[s] = attention_ref(query[s:s + 1], rows, rows[..., :kv_lora_rank], torch.tensor([seq_len - 1]),
                               scale)[0]
    return out


def copy_blocks_ref(kv_caches, block_mapping):
    """Copy-on-write: for every layer's cache and every (src, dst) pair, block dst becomes a copy of block src."""
    pairs = torch.as_tensor(block_mapping, dtype=torch.long).reshape(-1, 2)
    for kv_cache in kv_caches:
        src, dst = pairs[:, 0].to(kv_cache.device), pairs[:, 1].to(kv_cache.device)
        kv_cache[dst] = kv_cache[src]
    return kv_caches


def swap_blocks_ref(src, dst, block_mapping):
    """Swap: block d of ``dst`` becomes a copy of block s of ``src`` for each (s, d), across devices."""
    for s, d in torch.as_tensor(block_mapping, dtype=torch.long).reshape(-1, 2).tolist():
        dst[d].copy_(src[s])
    return dst
