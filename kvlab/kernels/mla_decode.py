"""MLA decode: DeepSeek-V2/V3's multi-head latent attention for one new token per sequence, over the latent
cache, absorbed (torch twin: ``kvlab.kernels.torch_paged.mla_decode_torch``; oracle:
``kvlab.kernels.reference.mla_decode_ref``).

Cache contract: one tensor per layer ``latent_cache[num_blocks, block_size, kv_lora_rank + rope_dim]``; a
row is one token's compressed KV (``kv_lora_rank`` features, after its RMSNorm) and then its rotated key
part, shared by every head. No separate V: a head's key and value are both linear in the row, so the
model folds the up-projections into the query and the output (``kvlab.engine.attention``):

* query ``[num_seqs, num_heads, kv_lora_rank + rope_dim]``: each head's no-rope query times its key
  up-projection (``q_nope @ W_UK``), then its rotated rope part;
* scores: query . row (the whole row: compressed part and rotary part), times the model's ``scale``;
* output ``[num_seqs, num_heads, kv_lora_rank]``: softmax-weighted compressed parts, which the model
  multiplies by each head's value up-projection ``W_UV``.

That is multi-query attention with one latent "head" of width ``kv_lora_rank + rope_dim`` whose values are
its first ``kv_lora_rank`` features, which is how vLLM's MLA decode kernels see it too.

Design
------
* Grid ``(num_seqs, cdiv(num_heads, BLOCK_H))``: a program takes ``BLOCK_H`` (16: one tensor-core tile of
  rows) query heads of one sequence, so each row tile is loaded once per 16 heads, not once per head.
* The row is loaded as two tiles, the compressed part ``[TILE_N, BLOCK_C]`` and the rotary part
  ``[TILE_N, BLOCK_R]`` (each padded to a power of two, at least 16, and masked: 512 + 64 would otherwise
  pad to 1024); the scores are the sum of two dots, and the compressed tile is the values too.
* Each token finds its block through the table (``pos // block_size``), loads are masked to the
  sequence's length, and online softmax runs in fp32 base 2 (``attention_tiles``). No split-K: a program
  walks the whole context.
* Pre-Ampere GPUs (a T4, 64 KiB of shared memory a block) take ``kv_lora_rank`` up to 256: DeepSeek's 512
  needs 68-72 KiB for the layout changes of its ``[16, 512]`` tiles there (tests/kernels/gpu_compile_check.py).
"""

import torch
import triton
import triton.language as tl

import kvlab.device  # noqa: F401  (first: selects the interpreter before any @triton.jit runs)
from kvlab.errors import InvalidArgumentError
from kvlab.kernels._checks import (check_block_tables, check_latent_cache, check_latent_query, check_seq_lens,
                                   check_tensor)
from kvlab.kernels.attention_tiles import LOG2E, NEG_BIG, online_softmax_step
from kvlab.validation import check_number

#: Query heads per program: the smallest ``tl.dot`` row count.
BLOCK_H = 16
#: The largest kv_lora_rank pre-Ampere GPUs (sm_75) take: see the module's docstring.
PRE_AMPERE_MAX_KV_LORA_RANK = 256
#: Tokens per tile: a [16, 512] compressed tile is 16 KiB in fp16 (and small tiles let the interpreter's tests
#: cross tiles and blocks).
TILE_N = 16


@triton.jit
def mla_decode_kernel(
    out_ptr, query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,  # out [seqs, heads, KV_LORA_RANK]
    scale, num_heads,
    stride_q_seq, stride_q_head, stride_o_seq, stride_o_head, stride_c_block, stride_c_slot,
    stride_bt_seq, stride_bt_col,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    c = tl.arange(0, BLOCK_C)  # compressed-part features; c >= KV_LORA_RANK is padding
    c_ok = c < KV_LORA_RANK
    r = tl.arange(0, BLOCK_R)  # rotary-part features, at KV_LORA_RANK + r in a row
    r_ok = r < ROPE_DIM
    q_rows = query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head
    q_c = tl.load(q_rows + c[None, :], mask=head_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_rows + KV_LORA_RANK + r[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)
    qk_scale = scale * LOG2E  # scores in log2 units for exp2

    seq_len = tl.load(seq_lens_ptr + seq)
    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt_seq
    for tile in range(0, tl.cdiv(seq_len, TILE_N)):
        pos = tile * TILE_N + tl.arange(0, TILE_N)
        pos_ok = pos < seq_len
        block_ids = tl.load(table_row + (pos // BLOCK_SIZE) * stride_bt_col, mask=pos_ok, other=0)
        rows = cache_ptr + block_ids.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE).to(tl.int64) * stride_c_slot
        k_c = tl.load(rows[:, None] + c[None, :], mask=pos_ok[:, None] & c_ok[None, :], other=0.0)
        k_r = tl.load(rows[:, None] + KV_LORA_RANK + r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0)
        s = tl.dot(q_c, tl.trans(k_c), input_precision=DOT_PRECISION)
        s += tl.dot(q_r, tl.trans(k_r), input_precision=DOT_PRECISION)
        s = tl.where(pos_ok[None, :], s * qk_scale, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, k_c, DOT_PRECISION)  # the compressed part is V

    out = acc / l_i[:, None]  # l_i >= 1: the row's largest score contributes exp2(0)
    tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + c[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & c_ok[None, :])


def mla_launch_config(num_seqs, num_heads, kv_lora_rank, rope_dim, block_size, dtype):
    """How ``mla_decode`` launches its kernel, from shapes alone, so tests/kernels/gpu_compile_variants.py
    compiles exactly what the launcher runs. Returns ``grid``, ``num_warps`` and the constexprs."""
    block_c = max(16, triton.next_power_of_2(kv_lora_rank))
    return dict(
        grid=(num_seqs, triton.cdiv(num_heads, BLOCK_H)),
        num_warps=8 if block_c >= 256 else 4,
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, BLOCK_H=BLOCK_H, BLOCK_C=block_c,
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def check_kv_lora_rank_fits(kv_lora_rank, device) -> None:
    """A pre-Ampere GPU's shared memory holds the kernel's tiles up to ``PRE_AMPERE_MAX_KV_LORA_RANK``."""
    if (device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0)
            and kv_lora_rank > PRE_AMPERE_MAX_KV_LORA_RANK):
        raise InvalidArgumentError(
            f"kv_lora_rank {kv_lora_rank} is too wide for mla_decode on {torch.cuda.get_device_name(device)} "
            f"(sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}): GPUs before Ampere take up to "
            f"{PRE_AMPERE_MAX_KV_LORA_RANK} (their 64 KiB of shared memory a block); use the torch path "
            "(mla_decode_torch, the engine's attention_backend='torch')")


def mla_decode(query, latent_cache, block_tables, seq_lens, kv_lora_rank, scale):
    """Absorbed MLA attention of one new token per sequence over its paged latent rows.

    query ``[num_seqs, num_heads, kv_lora_rank + rope_dim]`` (sequence s's token at position seq_lens[s] - 1),
    latent_cache ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` in query's dtype, block_tables int32
    ``[num_seqs, max_blocks_per_seq]``, seq_lens int32 ``[num_seqs]`` (each >= 1); any strides with a
    contiguous last dim. ``scale``: the model's softmax scale (1/sqrt of its query-key head dim, with YaRN's
    mscale; the latent width says nothing about it, so there is no default). Returns a new contiguous
    ``[num_seqs, num_heads, kv_lora_rank]`` tensor: each head's softmax-weighted compressed KV."""
    num_blocks, block_size, _ = check_latent_cache(latent_cache, kv_lora_rank)
    check_kv_lora_rank_fits(kv_lora_rank, latent_cache.device)
    check_latent_query(query, latent_cache)
    check_number("scale", scale, 0, min_open=True)
    num_seqs = query.shape[0]
    check_seq_lens(seq_lens, num_seqs, device=latent_cache.device, min_len=1)
    check_block_tables(block_tables, num_seqs, num_blocks, seq_lens, block_size)
    return mla_decode_unchecked(query, latent_cache, block_tables, seq_lens, kv_lora_rank, scale)


def check_latent_decode_step(latent_cache, kv_lora_rank, block_tables, seq_lens) -> None:
    """What ``mla_decode`` checks besides the query and scale, once for a step's layers (the engine, which
    then calls ``mla_decode_unchecked`` in every layer)."""
    num_blocks, block_size, _ = check_latent_cache(latent_cache, kv_lora_rank)
    check_kv_lora_rank_fits(kv_lora_rank, latent_cache.device)
    check_tensor(seq_lens, "seq_lens", ndim=1)
    check_seq_lens(seq_lens, seq_lens.shape[0], device=latent_cache.device, min_len=1)
    check_block_tables(block_tables, seq_lens.shape[0], num_blocks, seq_lens, block_size)


def mla_decode_unchecked(query, latent_cache, block_tables, seq_lens, kv_lora_rank, scale):
    """``mla_decode`` without its checks, for a caller that checked the step's tables once
    (``check_latent_decode_step``): nothing is read back to the host, and a block id out of range reads
    someone else's memory."""
    num_seqs, num_heads, latent_dim = query.shape
    out = torch.empty(num_seqs, num_heads, kv_lora_rank, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    config = mla_launch_config(num_seqs, num_heads, kv_lora_rank, latent_dim - kv_lora_rank,
                               latent_cache.shape[1], query.dtype)
    mla_decode_kernel[config.pop("grid")](
        out, query, latent_cache, block_tables, seq_lens, scale, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0), block_tables.stride(1),
        **config,
    )
    return out
