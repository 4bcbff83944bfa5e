"""Self-attention whose every K/V byte lives in kvlab's paged cache.

Per layer and step: project, (Qwen3: normalise q and k per head), rotate, write the new tokens' K/V into
their slots, and only then attend over each sequence's context through its block table (prompt tokens see
the cached prefix, so a prefix hit is compute skipped). Two backends do the writing and attending, on the
same cache, block tables and slot mappings:

* "triton": kvlab's kernels, ``reshape_and_cache`` then ``paged_prefill`` (prompt tokens) or
  ``paged_attention_decode`` (one new token per sequence); compiled on CUDA, interpreted on CPU. The step's
  slots and tables are checked once, by ``AttentionBatch.for_backend`` (``kvlab.kernels.step_checks``), and
  every layer launches the kernels unchecked: a step's tensor -> host reads do not grow with the layers.
  Debug switch: with ``KVLAB_CHECK_EVERY_LAYER=1`` in the environment when the ``LLM`` is made, every layer
  calls the public, checked launchers again (``kvlab.engine.settings.check_every_layer_from_env``).
* "torch": ``kvlab.kernels.torch_paged``, batched torch ops; its plans (where to store, what to gather and
  mask) are checked and made once per step by ``AttentionBatch.for_backend`` and shared by every layer, which
  writes and attends unchecked.

A quantized cache (``LLM(kv_cache_dtype=...)``): each layer's ``kv_quantizer`` (its format and scales,
``kvlab.kernels.kv_quant``) encodes K/V on write and decodes them on read, with the same plans
(``kvlab.kernels.torch_paged_quant``); None ("auto") runs exactly the unquantized code. With "triton" (fp8
formats, on GPUs with fp8: ``settings.resolve_quantized_backend``) the kernels take the quantizer's scales.
A KIVI cache (``kivi_int4``, ``kivi_int2``) keeps each sequence's newest tokens in full precision beside the
pages, in the layer's ``kv_window``: the torch path runs ``kvlab.kernels.torch_paged_quant.kivi_attention``,
"triton" ``kvlab.kernels.kivi_paged_attention.kivi_attention_triton`` (``kivi_seal`` writes whole chunks into
the pages, ``kivi_paged_attention`` reads them and the window; on any device, the interpreter's included).
``kv_observer``, set only during a calibration pass (``kvlab.engine.kv_calibration``), sees every K/V the
layer writes.

MLA (DeepSeek-V3, ``PagedLatentAttention``): each layer's cache holds one latent row per token
(``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, no V) and attention is *absorbed*: each
head's key and value up-projections (``kv_b_proj``) are folded into its query and its output, so every
step attends over the cached rows themselves, never over per-head K/V (what vLLM's MLA does for decode;
for prefill vLLM up-projects the context instead, which does less arithmetic on long prompts but gives the
same result). The row is written with a torch indexed store on both backends. "torch" attends with
``kvlab.kernels.torch_paged.latent_attention_torch``; "triton" runs ``kvlab.kernels.mla_decode`` for decode
steps and the torch path for steps with several query rows per sequence (prompt chunks, drafts), since
there is no Triton MLA prefill kernel yet.
"""

from dataclasses import dataclass

import torch
from torch import nn

from kvlab.engine.config import ModelConfig
from kvlab.engine.layers import MergedLinear, RMSNorm, Rotation
from kvlab.engine.parts import EngineParts
from kvlab.kernels import mla_decode, paged_attention_decode, paged_prefill, reshape_and_cache
from kvlab.kernels.mla_decode import check_latent_decode_step, mla_decode_unchecked
from kvlab.kernels.paged_attention_decode import paged_attention_decode_unchecked
from kvlab.kernels.paged_prefill import paged_prefill_unchecked
from kvlab.kernels.reshape_and_cache import reshape_and_cache_unchecked
from kvlab.kernels.kivi_paged_attention import kivi_attention_triton
from kvlab.kernels.kv_quant import KVQuantizer
from kvlab.kernels.step_checks import CheckedStep, check_paged_step
from kvlab.kernels.torch_paged import (CacheWrite, PagedPlan, latent_attention_torch_unchecked,
                                       paged_attention_torch_unchecked, plan_cache_write, plan_latent_attention,
                                       plan_latent_write, plan_paged_attention, write_cache, write_latent_cache)
from kvlab.kernels.torch_paged_quant import (KiviStep, ResidualWindow, kivi_attention, paged_attention_torch_quantized,
                                             plan_kivi_step, write_cache_quantized)


@dataclass
class AttentionBatch:
    """Where one step's tokens live in the paged cache (the same for every layer).

    ``slot_mapping`` int64 ``[T]``: cache slot of each new token. ``block_tables`` int32 ``[S, max_blocks]``,
    ``seq_lens`` int32 ``[S]``: every sequence's whole context, new tokens included. ``cu_query_lens`` int32
    ``[S + 1]`` (prefill only): sequence s owns query rows ``cu_query_lens[s]:cu_query_lens[s + 1]``.
    Decode has exactly one new token per sequence (T == S). ``sliding_window``: the layers' window in tokens
    (None: full attention); a model with several kinds of layer has one batch per kind, each with its group's
    tables and slots (``kvlab.engine.hybrid``). What the step's checks left for the layers: with "torch",
    ``plan`` and ``cache_write`` (what to gather and mask, where to store); with "triton", ``checked`` (the
    longest context, the prefill's tile map) and ``check_every_layer`` (the debug switch: every layer calls
    the public, checked launchers).
    """
    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_query_lens: torch.Tensor | None = None
    plan: PagedPlan | None = None
    cache_write: CacheWrite | None = None
    checked: CheckedStep | None = None
    sliding_window: int | None = None
    check_every_layer: bool = False
    kivi: KiviStep | None = None
    parts: EngineParts | None = None  # a learner's attention (kvlab.engine.parts; the torch backend only)

    def kivi_step(self, kv_cache: torch.Tensor, quantizer: KVQuantizer) -> KiviStep:
        """The step's KIVI plan, made by the first layer that asks and shared by the others (every layer of a
        KIVI cache has the same R, G and block size); the Triton backend's (no torch ``plan``) has no masks."""
        if self.kivi is None:
            self.kivi = plan_kivi_step(self.plan, self.block_tables, self.seq_lens, self.cu_query_lens,
                                       kv_cache.shape[2], quantizer.residual_length, quantizer.kivi[1])
        return self.kivi

    @classmethod
    def for_backend(cls, backend: str, kv_cache: torch.Tensor, *, is_prefill: bool, slot_mapping, block_tables,
                    seq_lens, cu_query_lens, max_seq_len: int, num_heads: int, sliding_window=None,
                    check_every_layer=False, query_dtype=None, kivi=None, parts=None) -> "AttentionBatch":
        """The step's batch for ``backend``, its metadata checked (once for every layer); ``cu_query_lens
        [S + 1]`` is given for decode too (0, 1, ... S). ``kv_cache``: any layer's cache (they share a
        layout); ``max_seq_len``: the longest ``seq_lens`` entry, known on the host; ``num_heads``: query heads;
        ``query_dtype``: theirs (the model's), which an fp8 cache needs for the Triton backend's prefill tile;
        ``kivi``: a KIVI cache's quantizer (any layer's: they share R, G and the format), whose Triton kernels
        the step's checks and tile map are then for; ``parts``: a learner's attention for the torch backend
        (``kvlab.engine.parts``; None: kvlab's)."""
        if backend == "torch":
            num_tokens = slot_mapping.shape[0]
            plan = plan_paged_attention(kv_cache, block_tables, seq_lens, cu_query_lens, num_tokens, sliding_window)
            return cls(is_prefill, slot_mapping, block_tables, seq_lens, cu_query_lens if is_prefill else None,
                       plan=plan, cache_write=plan_cache_write(kv_cache, slot_mapping, num_tokens),
                       sliding_window=sliding_window, parts=parts)
        cu_query_lens = cu_query_lens if is_prefill else None  # decode: the kernel takes one query per sequence
        checked = check_paged_step(kv_cache, num_heads, slot_mapping, block_tables, seq_lens, cu_query_lens,
                                   max_seq_len=max_seq_len, sliding_window=sliding_window, query_dtype=query_dtype,
                                   kivi=kivi)
        return cls(is_prefill, slot_mapping, block_tables, seq_lens, cu_query_lens, checked=checked,
                   sliding_window=sliding_window, check_every_layer=check_every_layer)

    @classmethod
    def for_latent_cache(cls, backend: str, latent_cache: torch.Tensor, kv_lora_rank: int, *, is_prefill: bool,
                         slot_mapping, block_tables, seq_lens, cu_query_lens,
                         check_every_layer=False) -> "AttentionBatch":
        """``for_backend`` for an MLA model (``latent_cache``: any layer's ``[num_blocks, block_size,
        latent_dim]``). Both backends write rows by ``cache_write``; the torch backend, and any step with
        several query rows per sequence, attend by ``plan``; the Triton backend's decode steps (``plan``
        None) run ``mla_decode``, their tables checked here once."""
        num_tokens = slot_mapping.shape[0]
        cache_write = plan_latent_write(latent_cache, kv_lora_rank, slot_mapping, num_tokens)
        if backend == "torch" or is_prefill:
            plan = plan_latent_attention(latent_cache, kv_lora_rank, block_tables, seq_lens, cu_query_lens,
                                         num_tokens)
            return cls(is_prefill, slot_mapping, block_tables, seq_lens, cu_query_lens if is_prefill else None,
                       plan=plan, cache_write=cache_write)
        check_latent_decode_step(latent_cache, kv_lora_rank, block_tables, seq_lens)
        return cls(is_prefill, slot_mapping, block_tables, seq_lens, cache_write=cache_write,
                   check_every_layer=check_every_layer)


class PagedSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(hidden, {"q_proj": self.num_heads * self.head_dim, "k_proj": kv_size,
                                              "v_proj": kv_size}, bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = self.head_dim ** -0.5
        self.kv_quantizer: KVQuantizer | None = None  # None: the cache holds K/V in the model's dtype
        self.kv_observer = None                        # calibration only: called with (k, v) [T, KH, D]
        self.kv_window: ResidualWindow | None = None   # a KIVI cache's full-precision open chunks

    def forward(self, x: torch.Tensor, rotation: Rotation, kv_cache: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``; kv_cache ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotation.apply(q, k)
        # The ordering rule: this step's K/V are in the cache before any query reads it (a sequence that hit
        # a prefix another sequence is computing in this very step reads it here).
        if self.kv_observer is not None:
            self.kv_observer(k, v)
        if batch.plan is not None and self.kv_window is not None:  # the torch backend, KIVI cache
            out = kivi_attention(q, k, v, kv_cache, batch.kivi_step(kv_cache, self.kv_quantizer), self.kv_quantizer,
                                 self.kv_window, scale=self.scale)
        elif batch.plan is not None and self.kv_quantizer is not None:  # the torch backend, quantized cache
            write_cache_quantized(k, v, kv_cache, batch.cache_write, self.kv_quantizer)
            out = paged_attention_torch_quantized(q, kv_cache, batch.plan, self.kv_quantizer, scale=self.scale)
        elif batch.plan is not None and batch.parts is not None and batch.parts.replaces_attention:
            batch.parts.write(k, v, kv_cache, batch)  # the torch backend, with a learner's parts
            out = batch.parts.attend(q, kv_cache, batch, self.scale)
        elif batch.plan is not None:  # the torch backend
            write_cache(k, v, kv_cache, batch.cache_write)
            out = paged_attention_torch_unchecked(q, kv_cache, batch.plan, scale=self.scale)
        elif self.kv_window is not None:  # the triton backend, KIVI cache
            out = kivi_attention_triton(q, k, v, kv_cache, batch.kivi_step(kv_cache, self.kv_quantizer),
                                        self.kv_quantizer, self.kv_window, batch.block_tables, batch.seq_lens,
                                        batch.cu_query_lens, batch.checked.tile_map, self.scale,
                                        checked=batch.check_every_layer)
        elif batch.check_every_layer:
            out = self._triton_checked(q, k, v, kv_cache, batch)
        else:  # checked once for the step by for_backend
            scales = self._fp8_scales()
            reshape_and_cache_unchecked(k, v, kv_cache, batch.slot_mapping, **scales)
            if batch.is_prefill:
                out = paged_prefill_unchecked(q, kv_cache, batch.block_tables, batch.seq_lens, batch.cu_query_lens,
                                              batch.checked.tile_map, self.scale, batch.sliding_window, **scales)
            else:
                out = paged_attention_decode_unchecked(q, kv_cache, batch.block_tables, batch.seq_lens,
                                                       batch.checked.max_seq_len, self.scale, batch.sliding_window,
                                                       **scales)
        return self.o_proj(out.view(tokens, self.num_heads * self.head_dim))

    def _fp8_scales(self) -> dict:
        """The Triton kernels' ``k_scale`` / ``v_scale`` for this layer's fp8 cache (``[num_kv_heads]`` each, as
        the quantizer holds them); none for an unquantized one (the only other kind the backend is given)."""
        if self.kv_quantizer is None:
            return {}
        return dict(k_scale=self.kv_quantizer.k_scale, v_scale=self.kv_quantizer.v_scale)

    def _triton_checked(self, q, k, v, kv_cache, batch: AttentionBatch) -> torch.Tensor:
        """The public launchers, which check their arguments on every call (the debug switch)."""
        scales = self._fp8_scales()
        reshape_and_cache(k, v, kv_cache, batch.slot_mapping, **scales)
        if batch.is_prefill:
            return paged_prefill(q, kv_cache, batch.block_tables, batch.seq_lens, batch.cu_query_lens,
                                 scale=self.scale, sliding_window=batch.sliding_window, **scales)
        return paged_attention_decode(q, kv_cache, batch.block_tables, batch.seq_lens, scale=self.scale,
                                      sliding_window=batch.sliding_window, **scales)


class PagedLatentAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention (``kvlab.engine.config.MLAConfig``) on a latent paged cache,
    absorbed (see the module's docstring). Module names are transformers' (``q_a_proj`` and
    ``kv_a_proj_with_mqa`` load into one merged GEMM of the hidden state, ``qkv_a_proj``, where the queries are
    low-rank; ``q_proj`` and ``kv_a_proj_with_mqa`` otherwise)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        mla = self.mla = config.mla
        self.num_heads, hidden, bias = config.num_heads, config.hidden_size, config.attention_bias
        query_size = self.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, query_size, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias)
        else:
            self.qkv_a_proj = MergedLinear(hidden, {"q_a_proj": mla.q_lora_rank,
                                                    "kv_a_proj_with_mqa": mla.latent_dim}, bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)  # transformers' default eps, not rms_norm_eps
            self.q_b_proj = nn.Linear(mla.q_lora_rank, query_size, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * mla.v_head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, rotation: Rotation, latent_cache: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``; latent_cache ``[num_blocks, block_size, latent_dim]``."""
        mla, tokens = self.mla, x.shape[0]
        if mla.q_lora_rank is None:
            q, latent = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        else:
            q_a, latent = self.qkv_a_proj(x)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        q_nope, q_rope = q.view(tokens, self.num_heads, -1).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        compressed, k_rope = latent.split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
        rotate = rotation.apply_interleaved if mla.rope_interleave else rotation.apply
        q_rope, k_rope = rotate(q_rope, k_rope[:, None])
        # The cache row: the normed compressed KV, then the rotated key part (shared by every head).
        rows = torch.cat((self.kv_a_layernorm(compressed), k_rope[:, 0]), dim=-1)
        # kv_b_proj maps the compressed KV to each head's no-rope key and value: [H, nope + v, kv_lora_rank].
        w_uk, w_uv = self.kv_b_proj.weight.view(self.num_heads, -1, mla.kv_lora_rank).split(
            [mla.qk_nope_head_dim, mla.v_head_dim], 1)
        # q_nope . (W_UK c) = (W_UK^T q_nope) . c: each head's query in the latent space, then its rope part.
        query = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope), dim=-1)
        write_latent_cache(rows, latent_cache, batch.cache_write)  # before any query reads the cache
        if batch.plan is not None:
            out = latent_attention_torch_unchecked(query, latent_cache, batch.plan, mla.kv_lora_rank,
                                                   mla.softmax_scale)
        elif batch.check_every_layer:
            out = mla_decode(query, latent_cache, batch.block_tables, batch.seq_lens, mla.kv_lora_rank,
                             mla.softmax_scale)
        else:  # checked once for the step by for_latent_cache
            out = mla_decode_unchecked(query, latent_cache, batch.block_tables, batch.seq_lens, mla.kv_lora_rank,
                                       mla.softmax_scale)
        # Each head's weighted compressed KV through its value up-projection: [T, H, v_head_dim].
        out = torch.einsum("thr,hvr->thv", out, w_uv)
        return self.o_proj(out.reshape(tokens, self.num_heads * mla.v_head_dim))
