"""Paged attention for decode: each sequence's one new query token reads its whole context through the
block table (oracle: ``kvlab.kernels.reference.paged_attention_decode_ref``).

Design
------
* Grid ``(num_seqs, num_kv_heads, num_partitions)``. One program owns every query head that shares a KV
  head (grouped-query attention), as the rows of a ``[GROUP_PAD, BLOCK_D]`` query tile, so each K/V tile is
  loaded once per KV head and multiplied against the whole group with one ``tl.dot``.
* The context is walked in tiles of ``TILE_N`` tokens. A tile need not line up with cache blocks: every token
  looks up its own block id (``block_table[pos // block_size]``), so any block size works and a tile may
  straddle blocks. Loads are masked to ``[kv_lo, seq_len)``, so block-table entries the sequence does not use
  (padding, blocks dropped by the sliding window) are never read.
* Online softmax in fp32 (base 2: scores are pre-multiplied by log2(e) so ``exp2`` does the work).
* Split-K ("flash-decoding"): with ``num_partitions > 1`` each program takes an equal share of the
  sequence's tiles and writes its partial (running max, sum, unnormalised accumulator); ``split_k_reduce``
  merges them. Without it, the one partition normalises and writes the output directly.

The tile helpers (``load_kv_tile``, ``attention_scores``, ``online_softmax_step``) live in
``attention_tiles``, shared with ``paged_prefill``.
"""

import torch
import triton
import triton.language as tl

from kvlab.device import ON_GPU  # first: selects the interpreter before any @triton.jit runs
from kvlab.errors import InvalidArgumentError
from kvlab.kernels._checks import (FP8_CACHE_DTYPES, check_attention_options, check_block_tables, check_kv_cache,
                                   check_kv_scales, check_query, check_seq_lens)
from kvlab.kernels.attention_tiles import NEG_BIG, attention_scores, load_kv_tile, online_softmax_step
from kvlab.kernels.split_k_reduce import split_k_reduce
from kvlab.validation import is_int

#: Tokens per K/V tile on a GPU, and in the interpreter, whose cost is per op (small tiles also let tests
#: cross blocks). ``decode_launch_config`` picks between them and knows the exception (fp32 head_dim 256 on
#: pre-Ampere GPUs).
GPU_TILE_N, INTERPRETER_TILE_N = 32, 16
#: The tile this process's launches use for most shapes (notebook 05 draws it).
DECODE_TILE_N = GPU_TILE_N if ON_GPU else INTERPRETER_TILE_N
#: A partition shorter than this many tokens costs more to write out and reduce than it saves.
MIN_PARTITION_TOKENS = 256
MAX_PARTITIONS = 64


@triton.jit
def paged_attention_decode_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,  # out [seqs, heads, D]; partials [seqs, heads, P(, D)]
    query_ptr, kv_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale, soft_cap, sliding_window, num_heads, num_partitions,
    stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
    stride_c_block, stride_c_kv, stride_c_slot, stride_c_head, stride_bt_seq, stride_bt_col,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    k_scale_ptr=None, v_scale_ptr=None, FP8: tl.constexpr = False,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)

    rows = tl.arange(0, GROUP_PAD)  # query head kv_head * GROUP + row; rows >= GROUP are padding
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # The query sits at position seq_len - 1 and sees keys [kv_lo, seq_len). Tiles wholly before kv_lo
    # (outside the sliding window) are never visited.
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - sliding_window, 0)
    first_tile = kv_lo // TILE_N
    end_tile = tl.cdiv(seq_len, TILE_N)
    tiles_per_part = tl.cdiv(end_tile - first_tile, num_partitions)
    tile_lo = first_tile + part * tiles_per_part
    tile_hi = tl.minimum(tile_lo + tiles_per_part, end_tile)  # may be <= tile_lo: an empty partition

    m_i = tl.full([GROUP_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt_seq
    head_offset = kv_head.to(tl.int64) * stride_c_head
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + tl.arange(0, TILE_N)
        pos_ok = (pos >= kv_lo) & (pos < seq_len)
        k, v = load_kv_tile(kv_cache_ptr, table_row, stride_bt_col, head_offset, pos, pos_ok, d, d_ok,
                            stride_c_block, stride_c_kv, stride_c_slot, BLOCK_SIZE)
        if FP8:  # dequantize: code * the KV head's scale, in the query's dtype
            k = (k.to(tl.float32) * tl.load(k_scale_ptr + kv_head)).to(q.dtype)
            v = (v.to(tl.float32) * tl.load(v_scale_ptr + kv_head)).to(q.dtype)
        s = attention_scores(q, k, scale, soft_cap, USE_SOFT_CAP, DOT_PRECISION)
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

    if SPLIT:
        part_row = (seq * num_heads + heads) * num_partitions + part  # [GROUP_PAD] index into [seqs, heads, P]
        tl.store(part_max_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        out = acc / l_i[:, None]  # l_i >= 1: the row's largest score contributes exp2(0)
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def compute_units(device) -> int:
    """Programs the device runs at once: the SM count on a GPU. The interpreter runs one program after
    another, so on CPU there is nothing idle for split-K to fill: 1."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_partitions(num_seqs, num_kv_heads, context_len, num_sms):
    """Split-K heuristic. Without splitting the grid has num_seqs * num_kv_heads programs; when that leaves
    SMs idle and the context is long, cut each context into partitions until there are about two programs
    per SM, keeping every partition at least MIN_PARTITION_TOKENS long. Returns 1 for "do not split"."""
    programs = num_seqs * num_kv_heads
    if programs == 0 or programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, programs)
    by_length = context_len // MIN_PARTITION_TOKENS
    return max(1, min(by_occupancy, by_length, MAX_PARTITIONS))


def _resolve_split_k(split_k, num_seqs, num_kv_heads, context_len, num_sms):
    """``split_k``: None = heuristic, False = one partition, True = split (heuristic count, at least 2), an int
    n >= 1 = exactly n partitions. Returns the number of partitions."""
    if split_k is None or isinstance(split_k, bool):
        if split_k is False:
            return 1
        n = choose_num_partitions(num_seqs, num_kv_heads, context_len, num_sms)
        return max(n, 2) if split_k else n
    if not is_int(split_k) or not 1 <= split_k <= 1024:
        raise InvalidArgumentError(f"split_k must be None (auto), True, False or an int number of partitions "
                                   f"in [1, 1024], got {split_k!r}")
    return int(split_k)


def decode_launch_config(num_seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, max_seq_len,
                         split_k=None, capability=None, num_sms=1, sliding_window=None, soft_cap=None):
    """How ``paged_attention_decode`` launches its kernel, decided from shapes and the device alone, so that
    tests/kernels/gpu_compile_variants.py compiles exactly what the launcher runs.

    ``capability``: the GPU's compute capability ``(major, minor)``, None in the interpreter; ``num_sms``:
    ``compute_units(device)``. Returns ``grid`` = (num_seqs, num_kv_heads, num_partitions), ``num_warps`` and
    every constexpr of ``paged_attention_decode_kernel``. Raises InvalidArgumentError for a bad ``split_k``.
    """
    context_len = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    num_partitions = _resolve_split_k(split_k, num_seqs, num_kv_heads, context_len, num_sms)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    tile_n = INTERPRETER_TILE_N if capability is None else GPU_TILE_N
    if capability is not None and capability < (8, 0) and dtype == torch.float32 and block_d >= 256:
        # K and V [32, 256] fp32 tiles plus the query take 80 KiB of shared memory, [16, 256] ones 48; a T4
        # (sm_75) has 64.
        tile_n = GPU_TILE_N // 2
    return dict(
        grid=(num_seqs, num_kv_heads, num_partitions),
        num_warps=8 if block_d >= 128 else 4,  # keeps [TILE_N, 256] fp32 tiles out of local memory (sm_90)
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),  # >= 16: one tensor-core tile of rows
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE_N=tile_n,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None, SPLIT=num_partitions > 1,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def paged_attention_decode(query, kv_cache, block_tables, seq_lens, scale=None, sliding_window=None,
                           soft_cap=None, split_k=None, k_scale=None, v_scale=None):
    """Attention of one new token per sequence over its paged context.

    query ``[num_seqs, num_heads, head_dim]`` (token of sequence s at position seq_lens[s] - 1), kv_cache
    ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` in query's dtype, block_tables int32
    ``[num_seqs, max_blocks_per_seq]``, seq_lens int32 ``[num_seqs]`` (each >= 1). Any strides with a
    contiguous last dim. ``scale`` defaults to 1/sqrt(head_dim); ``sliding_window=W`` keeps the last W keys;
    ``soft_cap=c`` maps scores to c*tanh(s/c); ``split_k`` see ``_resolve_split_k``. Returns a new
    contiguous ``[num_seqs, num_heads, head_dim]`` tensor.

    An fp8 cache (float8_e4m3fn / float8_e5m2, written by ``reshape_and_cache`` with the same scales) is
    dequantized on read, ``code * k_scale[kv_head]`` (``k_scale``, ``v_scale``: fp32 ``[num_kv_heads]``), with
    query in a float dtype; this runs in the interpreter too (its fp8 -> float conversion is exact).
    """
    fp8 = isinstance(kv_cache, torch.Tensor) and kv_cache.dtype in FP8_CACHE_DTYPES
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(
        kv_cache, storage_dtypes=FP8_CACHE_DTYPES if fp8 else None)
    num_heads = check_query(query, kv_cache)
    check_kv_scales(k_scale, v_scale, num_kv_heads, kv_cache, fp8)
    scale, sliding_window, soft_cap = check_attention_options(scale, sliding_window, soft_cap)
    num_seqs = query.shape[0]
    max_seq_len = check_seq_lens(seq_lens, num_seqs, device=kv_cache.device, min_len=1)
    check_block_tables(block_tables, num_seqs, num_blocks, seq_lens, block_size)
    return paged_attention_decode_unchecked(query, kv_cache, block_tables, seq_lens, max_seq_len, scale,
                                            sliding_window, soft_cap, split_k, k_scale, v_scale)


def paged_attention_decode_unchecked(query, kv_cache, block_tables, seq_lens, max_seq_len: int, scale=None,
                                     sliding_window=None, soft_cap=None, split_k=None, k_scale=None, v_scale=None):
    """``paged_attention_decode`` without its checks, for a caller that checked the step's tables once and
    attends many layers with them (the engine, ``kvlab.kernels.step_checks``): no tensor -> host read.
    ``max_seq_len``: the longest ``seq_lens`` entry, known on the host (it sizes split-K). Nothing is
    checked, so a block id out of range reads someone else's memory; ``split_k`` is still refused if bad."""
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    device = kv_cache.device
    config = decode_launch_config(
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, query.dtype, max_seq_len, split_k,
        capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        num_sms=compute_units(device), sliding_window=sliding_window, soft_cap=soft_cap)

    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    grid = config.pop("grid")
    num_partitions = grid[2]
    partials = [torch.empty(num_seqs, num_heads, num_partitions, *extra, dtype=torch.float32, device=query.device)
                for extra in ((), (), (head_dim,))] if config["SPLIT"] else [out, out, out]  # unused when not split
    paged_attention_decode_kernel[grid](
        out, *partials, query, kv_cache, block_tables, seq_lens,
        head_dim ** -0.5 if scale is None else scale, soft_cap or 0.0, sliding_window or 0,
        num_heads, num_partitions,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), block_tables.stride(1),
        **config, **({} if k_scale is None else dict(k_scale_ptr=k_scale, v_scale_ptr=v_scale, FP8=True)),
    )
    if config["SPLIT"]:
        split_k_reduce(out, *partials)
    return out
