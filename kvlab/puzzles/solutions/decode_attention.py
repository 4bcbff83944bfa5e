"""A solution of kvlab.puzzles.decode_attention."""

import torch


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    block_size, num_heads, num_kv_heads = kv_cache.shape[2], query.shape[1], kv_cache.shape[3]
    out = torch.empty_like(query)
    for s, n in enumerate(seq_lens.tolist()):
        positions = torch.arange(n)
        blocks = block_tables[s].long()[positions // block_size]      # [n]: the block of each position
        k = kv_cache[blocks, 0, positions % block_size].float()         # [n, H_kv, D]
        v = kv_cache[blocks, 1, positions % block_size].float()
        group = num_heads // num_kv_heads                               # query heads per KV head
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, H, D]
        scores = torch.einsum("hd,nhd->hn", query[s].float(), k) * scale    # [H, n]
        out[s] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(query.dtype)
    return out
