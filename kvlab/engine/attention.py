"""Self-attention whose every K/V byte lives in kvlab's paged cache.

Per layer and step: project, (Qwen3: normalise q and k per head), rotate, write the new tokens' K/V into
their slots, and only then attend over each sequence's context through its block table (prompt tokens see
the cached prefix, so a prefix hit is compute skipped). Two backends do the writing and attending, on the
same cache, block tables and slot mappings:

* "triton": kvlab's kernels, ``reshape_and_cache`` then ``paged_prefill`` (prompt tokens) or
  ``paged_attention_decode`` (one new token per sequence); compiled on CUDA, interpreted on CPU.
* "torch": ``kvlab.kernels.torch_paged``, batched torch ops; its plan (what to gather and mask) is made once
  per step by ``AttentionBatch.for_backend`` and shared by every layer.
"""

from dataclasses import dataclass

import torch
from torch import nn

from kvlab.engine.config import ModelConfig
from kvlab.engine.layers import RMSNorm, Rotation
from kvlab.kernels import paged_attention_decode, paged_prefill, reshape_and_cache
from kvlab.kernels.torch_paged import (PagedPlan, paged_attention_torch, plan_paged_attention,
                                       reshape_and_cache_torch)


@dataclass
class AttentionBatch:
    """Where one step's tokens live in the paged cache (the same for every layer).

    ``slot_mapping`` int64 ``[T]``: cache slot of each new token. ``block_tables`` int32 ``[S, max_blocks]``,
    ``seq_lens`` int32 ``[S]``: every sequence's whole context, new tokens included. ``cu_query_lens`` int32
    ``[S + 1]`` (prefill only): sequence s owns query rows ``cu_query_lens[s]:cu_query_lens[s + 1]``.
    Decode has exactly one new token per sequence (T == S). ``plan``: the torch backend's gather and mask
    for this step (None with "triton"). ``sliding_window``: the layers' window in tokens (None: full
    attention); a model with several kinds of layer has one batch per kind, each with its group's tables
    and slots (``kvlab.engine.hybrid``).
    """
    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_query_lens: torch.Tensor | None = None
    plan: PagedPlan | None = None
    sliding_window: int | None = None

    @classmethod
    def for_backend(cls, backend: str, kv_cache: torch.Tensor, *, is_prefill: bool, slot_mapping, block_tables,
                    seq_lens, cu_query_lens, sliding_window=None) -> "AttentionBatch":
        """The step's batch for ``backend``; ``cu_query_lens [S + 1]`` is given for decode too (0, 1, ... S).
        ``kv_cache``: any layer's cache (they share a layout), for the torch plan."""
        plan = (plan_paged_attention(kv_cache, block_tables, seq_lens, cu_query_lens, slot_mapping.shape[0],
                                     sliding_window) if backend == "torch" else None)
        return cls(is_prefill, slot_mapping, block_tables, seq_lens, cu_query_lens if is_prefill else None, plan,
                   sliding_window)


class PagedSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rotation: Rotation, kv_cache: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``; kv_cache ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``."""
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotation.apply(q, k)
        # The ordering rule: this step's K/V are in the cache before any query reads it (a sequence that hit
        # a prefix another sequence is computing in this very step reads it here).
        if batch.plan is not None:  # the torch backend
            reshape_and_cache_torch(k, v, kv_cache, batch.slot_mapping)
            out = paged_attention_torch(q, kv_cache, batch.plan, scale=self.scale)
        elif batch.is_prefill:
            reshape_and_cache(k, v, kv_cache, batch.slot_mapping)
            out = paged_prefill(q, kv_cache, batch.block_tables, batch.seq_lens, batch.cu_query_lens, scale=self.scale,
                                sliding_window=batch.sliding_window)
        else:
            reshape_and_cache(k, v, kv_cache, batch.slot_mapping)
            out = paged_attention_decode(q, kv_cache, batch.block_tables, batch.seq_lens, scale=self.scale,
                                         sliding_window=batch.sliding_window)
        return self.o_proj(out.view(tokens, self.num_heads * self.head_dim))
