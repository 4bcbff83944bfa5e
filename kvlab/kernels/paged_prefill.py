"""Prefill on a prefix-cache hit: only the new tokens are queries, but they attend to everything the cache
holds for their sequence, cached prefix included (oracle: ``kvlab.kernels.reference.paged_prefill_ref``).

Sequence s owns query rows ``cu_query_lens[s]:cu_query_lens[s+1]``: its q_len newest tokens, at positions
``seq_len - q_len ... seq_len - 1`` (causal mask aligned bottom-right). Their K/V are already in the cache.

Design
------
* Grid ``(num_query_tiles, num_kv_heads)``. The launcher cuts every sequence's new tokens into tiles of
  ``BLOCK_Q`` tokens and lists them in ``tile_map [num_query_tiles, 2]`` = (sequence, first new token of the
  tile), so sequences of any lengths share one launch and no program works on another sequence's padding.
  Tiles are listed heaviest first (most keys to read), so long ones do not straggle at the end of the grid.
* Grouped-query attention: a program's ``BLOCK_Q * GROUP_PAD`` query rows are its tokens times the query heads
  of one KV head (row r = token r // GROUP_PAD, head kv_head * GROUP + r % GROUP_PAD), so every K/V tile is
  read once per KV head and used by the whole group in one ``tl.dot``.
* A tile's queries sit at positions [first, last]; query i sees keys j with j <= i (and i - j < W with a
  sliding window). The program visits only key tiles overlapping [first - W + 1, last]: tiles beyond the
  causal diagonal or wholly before the window are skipped, and the mask handles the partial ones.
* K/V are fetched and the softmax is folded with the helpers of ``attention_tiles``, shared with decode
  (per-token block lookup, so any block size works; online softmax in fp32).
* An fp8 cache is dequantized on read as decode does it: ``code * scale[kv_head]``, in the query's dtype,
  before the dot (the cache holds codes written by ``reshape_and_cache`` with the same scales).
"""

import torch
import triton
import triton.language as tl

import kvlab.device  # noqa: F401  (first: selects the interpreter before any @triton.jit runs)
from kvlab.kernels._checks import (FP8_CACHE_DTYPES, check_attention_options, check_block_tables,
                                   check_cu_query_lens, check_kv_cache, check_kv_scales, check_query, check_seq_lens,
                                   check_tensor)
from kvlab.kernels.attention_tiles import NEG_BIG, attention_scores, load_kv_tile, online_softmax_step


def prefill_launch_config(num_heads, num_kv_heads, head_dim, block_size, dtype, capability=None,
                          sliding_window=None, soft_cap=None):
    """How ``paged_prefill`` launches its kernel, decided from shapes and the device alone, so that
    tests/kernels/gpu_compile_variants.py compiles exactly what the launcher runs. ``capability``: the GPU's
    compute capability ``(major, minor)``, None in the interpreter. Returns ``num_warps`` and every constexpr
    of ``paged_prefill_kernel``; the grid, ``(len(query_tile_map(..., BLOCK_Q)), num_kv_heads)``, depends on
    the query lengths. ``dtype``: the query's, in which the dots run (an fp8 cache is dequantized to it).

    A program holds ``rows`` = BLOCK_Q tokens x GROUP_PAD heads of queries and walks keys ``TILE_N`` at a
    time. On a GPU these are the largest tiles that fit the register file and shared memory, as ptxas builds
    them for sm_75/80/90 (tests/kernels/test_gpu_compile.py): fp32 dots run without tensor cores, so fp32
    gets smaller tiles, and so does sm_75, whose fp16 dots need far more registers (231 of 255 at head_dim
    256 even so). Registers are not a hard wall for ptxas: at fp32 head_dim 128 GQA-8 on sm_90 it stops at
    64 per thread and spills 4 bytes (8 bytes of stack) rather than lose occupancy. In the interpreter the
    cost is per op, and small tiles let tests cross several of them.
    """
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if capability is None:
        rows, tile_n, num_warps = 32, 16, 4
    elif dtype == torch.float32 and block_d >= 256 and capability < (8, 0):
        # 32 fp32 query rows plus K and V [16, 256] would take all 64 KiB of a T4's shared memory: 16 rows
        # need 48 KiB.
        rows, tile_n, num_warps = 16, 16, 8
    elif dtype == torch.float32 or capability < (8, 0):
        rows, tile_n, num_warps = 32, 16, 8
    else:
        rows, tile_n, num_warps = (32 if block_d >= 256 else 64), 32, 8
    return dict(
        num_warps=num_warps, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=max(1, rows // group_pad),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE_N=tile_n,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


@triton.jit
def paged_prefill_kernel(
    out_ptr, query_ptr, kv_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_query_lens_ptr, tile_map_ptr,
    scale, soft_cap, sliding_window,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_kv, stride_c_slot, stride_c_head, stride_bt_seq, stride_bt_col,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    k_scale_ptr=None, v_scale_ptr=None, FP8: tl.constexpr = False,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_map_ptr + 2 * tile).to(tl.int64)
    q_start = tl.load(tile_map_ptr + 2 * tile + 1)  # first new token of this tile, counted within the sequence
    seq_len = tl.load(seq_lens_ptr + seq)
    first_row = tl.load(cu_query_lens_ptr + seq)  # the sequence's first row in query / out
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - first_row
    prefix_len = seq_len - q_len  # tokens before the first new one: new token t sits at prefix_len + t

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_start + rows // GROUP_PAD
    heads = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (rows % GROUP_PAD < GROUP) & (tok < q_len)
    q_pos = prefix_len + tok  # [ROWS] absolute positions
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    token_row = (first_row + tok).to(tl.int64)
    q = tl.load(query_ptr + (token_row * stride_q_tok + heads * stride_q_head)[:, None] + d[None, :],
                mask=io_mask, other=0.0)

    first_pos = prefix_len + q_start
    kv_hi = tl.minimum(first_pos + BLOCK_Q, seq_len)  # one past the last query's position: nothing later is seen
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(first_pos - sliding_window + 1, 0)  # the first query's oldest visible key

    m_i = tl.full([BLOCK_Q * GROUP_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt_seq
    head_offset = kv_head.to(tl.int64) * stride_c_head
    for key_tile in range(kv_lo // TILE_N, tl.cdiv(kv_hi, TILE_N)):
        pos = key_tile * TILE_N + tl.arange(0, TILE_N)
        pos_ok = (pos >= kv_lo) & (pos < kv_hi)
        k, v = load_kv_tile(kv_cache_ptr, table_row, stride_bt_col, head_offset, pos, pos_ok, d, d_ok,
                            stride_c_block, stride_c_kv, stride_c_slot, BLOCK_SIZE)
        if FP8:  # dequantize: code * the KV head's scale, in the query's dtype
            k = (k.to(tl.float32) * tl.load(k_scale_ptr + kv_head)).to(q.dtype)
            v = (v.to(tl.float32) * tl.load(v_scale_ptr + kv_head)).to(q.dtype)
        s = attention_scores(q, k, scale, soft_cap, USE_SOFT_CAP, DOT_PRECISION)
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - pos[None, :] < sliding_window)
        s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

    # A real row sees at least its own key (l_i >= 1); padding rows may see none and are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (token_row * stride_o_tok + heads * stride_o_head)[:, None] + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def query_tile_map(cu_query_lens, seq_lens, block_q):
    """int32 ``[num_query_tiles, 2]``: (sequence, first new token) of every BLOCK_Q-token query tile, the
    tiles that read the most keys first. Sequences with no new tokens get no tile."""
    num_seqs = seq_lens.shape[0]
    device = seq_lens.device
    q_lens = (cu_query_lens[1:] - cu_query_lens[:-1]).long()
    tiles_per_seq = (q_lens + block_q - 1) // block_q
    seq_of_tile = torch.repeat_interleave(torch.arange(num_seqs, device=device), tiles_per_seq)
    first_tile_of_seq = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq
    q_start = (torch.arange(seq_of_tile.shape[0], device=device) - first_tile_of_seq[seq_of_tile]) * block_q
    keys_read = seq_lens.long()[seq_of_tile] - q_lens[seq_of_tile] + q_start  # up to the tile's first query
    order = torch.argsort(keys_read, descending=True, stable=True)
    return torch.stack([seq_of_tile, q_start], 1)[order].to(torch.int32).contiguous()


def paged_prefill(query, kv_cache, block_tables, seq_lens, cu_query_lens, scale=None, sliding_window=None,
                  soft_cap=None, k_scale=None, v_scale=None):
    """Attention of each sequence's new tokens over its whole paged context (cached prefix + new tokens).

    query ``[total_new_tokens, num_heads, head_dim]`` (rows ``cu_query_lens[s]:cu_query_lens[s+1]`` are
    sequence s's newest tokens), kv_cache ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` in query's
    dtype already holding all ``seq_lens[s]`` tokens, block_tables int32 ``[num_seqs, max_blocks_per_seq]``,
    seq_lens int32 ``[num_seqs]`` (each >= 1), cu_query_lens int32 ``[num_seqs + 1]`` (q_len <= seq_len).
    Any strides with a contiguous last dim. Options as in ``paged_attention_decode``. Returns a new
    contiguous ``[total_new_tokens, num_heads, head_dim]`` tensor.

    An fp8 cache (float8_e4m3fn / float8_e5m2) is read as ``paged_attention_decode`` reads it: dequantized,
    ``code * k_scale[kv_head]`` (``k_scale``, ``v_scale``: fp32 ``[num_kv_heads]``), with query in any float
    cache dtype; this runs in the interpreter too.
    """
    fp8 = isinstance(kv_cache, torch.Tensor) and kv_cache.dtype in FP8_CACHE_DTYPES
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(
        kv_cache, storage_dtypes=FP8_CACHE_DTYPES if fp8 else None)
    num_heads = check_query(query, kv_cache)
    check_kv_scales(k_scale, v_scale, num_kv_heads, kv_cache, fp8)
    scale, sliding_window, soft_cap = check_attention_options(scale, sliding_window, soft_cap)
    check_tensor(seq_lens, "seq_lens", ndim=1)
    num_seqs = seq_lens.shape[0]
    check_seq_lens(seq_lens, num_seqs, device=kv_cache.device, min_len=1)
    check_block_tables(block_tables, num_seqs, num_blocks, seq_lens, block_size)
    check_cu_query_lens(cu_query_lens, num_seqs, query.shape[0], seq_lens)
    tile_map = prefill_tile_map(num_heads, kv_cache, cu_query_lens, seq_lens, query.dtype)
    return paged_prefill_unchecked(query, kv_cache, block_tables, seq_lens, cu_query_lens, tile_map, scale,
                                   sliding_window, soft_cap, k_scale, v_scale)


def _capability(device):
    """The GPU's compute capability, None in the interpreter (what the launch configs take)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def prefill_tile_map(num_heads, kv_cache, cu_query_lens, seq_lens, query_dtype=None):
    """``query_tile_map`` with the tile ``paged_prefill`` launches for ``num_heads`` query heads of
    ``query_dtype`` (None: the cache's, as a float cache's query has) on ``kv_cache``: the same for every layer
    of a model, so an engine makes it once per step. The launch sizes its tile by the query's dtype, so an fp8
    cache needs it given: a tile map made for another BLOCK_Q would leave new tokens out."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    config = prefill_launch_config(num_heads, num_kv_heads, head_dim, block_size, query_dtype or kv_cache.dtype,
                                   capability=_capability(kv_cache.device))
    return query_tile_map(cu_query_lens, seq_lens, config["BLOCK_Q"])


def paged_prefill_unchecked(query, kv_cache, block_tables, seq_lens, cu_query_lens, tile_map, scale=None,
                            sliding_window=None, soft_cap=None, k_scale=None, v_scale=None):
    """``paged_prefill`` without its checks, for a caller that checked the step's tables once and attends
    many layers with them (the engine, ``kvlab.kernels.step_checks``): no tensor -> host read. ``tile_map``:
    ``prefill_tile_map``'s. Nothing is checked, so a block id out of range reads someone else's memory."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    config = prefill_launch_config(num_heads, num_kv_heads, head_dim, block_size, query.dtype,
                                   capability=_capability(query.device), sliding_window=sliding_window,
                                   soft_cap=soft_cap)
    if tile_map.shape[0] == 0:
        return out
    paged_prefill_kernel[(tile_map.shape[0], num_kv_heads)](
        out, query, kv_cache, block_tables, seq_lens, cu_query_lens, tile_map,
        head_dim ** -0.5 if scale is None else scale, soft_cap or 0.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), block_tables.stride(1),
        **config, **({} if k_scale is None else dict(k_scale_ptr=k_scale, v_scale_ptr=v_scale, FP8=True)),
    )
    return out
