"""A solution of kvlab.puzzles.prefill_attention."""

import torch


def prefill_attention(query, kv_cache, block_table, seq_len, scale):
    new, heads, _ = query.shape
    bs, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    positions = torch.arange(seq_len)
    blocks = block_table.long()[positions // bs]
    k = kv_cache[blocks, 0, positions % bs].float().repeat_interleave(heads // kv_heads, 1)  # [seq_len, H, D]
    v = kv_cache[blocks, 1, positions % bs].float().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,nhd->htn", query.float(), k) * scale  # [H, T, seq_len]
    first = seq_len - new  # row i is position first + i: it sees keys 0 .. first + i
    causal = positions[None, :] <= first + torch.arange(new)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("htn,nhd->thd", scores.softmax(-1), v).to(query.dtype)
