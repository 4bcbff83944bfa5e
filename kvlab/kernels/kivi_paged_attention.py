"""KIVI's read in Triton: paged attention over a KIVI cache (``kivi_int4``, ``kivi_int2``) that dequantizes the
pages on the fly and reads each query's own R-chunk from a full-precision buffer, for decode (one query per
sequence) and prefix prefill (a chunk of new tokens over a cached prefix). The torch twin is
``kvlab.kernels.torch_paged_quant.kivi_read_torch``; the write (sealing whole chunks into the pages) is
``kvlab.kernels.kivi_seal``, which must run first. ``kivi_attention_triton`` is one layer of a step with both,
as the engine's Triton backend runs it (``kvlab.kernels.torch_paged_quant.kivi_attention``'s steps).

What a query reads (``KiviStep``): the query at position p sees positions below ``R floor(p / R)`` as KIVI
codes in the pages and positions ``R floor(p / R)`` .. p in full precision. The full-precision K/V of a
sequence are given as ``open_kv [2, S, C, H_kv, D]``: ``open_kv[:, s, i]`` is position ``open_start(s) + i``,
``open_start(s) = R floor((seq_len - q_len) / R)``, the start of the chunk its first new token is in (its open
chunk, from the window, then its new tokens).

Design
------
* One kernel, ``kivi_paged_attention_kernel``, grid ``(query tiles, num_kv_heads)`` as ``paged_prefill``'s
  (``query_tile_map``: (sequence, first new token) per tile, heaviest first); decode is its case of one query
  per sequence, launched with one token a tile and the query heads of a KV head padded to 16 rows, as
  ``paged_attention_decode`` holds them (``kivi_launch_config``).
* Two passes fold into one online softmax (``attention_tiles``): the codes, positions below the chunk start
  of the tile's last query, each row masked to its own chunk start; then the full-precision buffer from the
  chunk start of the tile's first query to its last query, each row masked to [its chunk start, its
  position]. Every key is in exactly one of the two for every row.
* Dequantizing a tile (``load_kivi_tile``; layout in ``kvlab.kernels.kv_quant``): a key channel's code is
  ``BITS`` bits of the row's byte ``c // (8 / BITS)``; its fp16 scale and zero sit in the rows of its key
  group (G rows, all in the token's block, since G divides the block size), bytes ``2c`` and ``2 D + 2c`` of
  the group's meta spread ``4 D / G`` to a row. A value's code is in the V part of the row and its (scale,
  zero) pair after the V codes, one per ``gcd(D, G)`` channels. Records split over the cache's K and V
  halves at W (``kivi_seal.record_byte_ptr``). Dequantized K/V go to the query's dtype before the dots.
* Every load is masked to positions the sequence has written: unused pages, slots past a sequence's sealed
  chunks, block-table padding and the buffer's padding are never read.
"""

import torch
import triton
import triton.language as tl

from kvlab.device import ON_GPU  # noqa: F401  (before any @triton.jit: selects the interpreter without a GPU)
from kvlab.errors import InvalidArgumentError
from kvlab.kernels._checks import (CACHE_DTYPES, check_attention_options, check_block_tables, check_cache_dtype,
                                   check_cu_query_lens, check_kernel_device, check_seq_lens, check_tensor)
from kvlab.kernels.attention_tiles import NEG_BIG, attention_scores, online_softmax_step
from kvlab.kernels.kivi_seal import kivi_seal, record_byte_ptr
from kvlab.kernels.kv_quant import KVQuantizer
from kvlab.kernels.paged_prefill import query_tile_map
from kvlab.kernels.torch_paged_quant import KiviStep, ResidualWindow, kivi_open_chunks, kivi_stage
from kvlab.sizing.kv_dtypes import kivi_value_group


@triton.jit
def _fp16_at(cache_ptr, blocks, offsets, head, byte, mask, W, stride_block, stride_kv, stride_slot, stride_head):
    """The fp16 stored at record bytes ``byte``, ``byte + 1`` (little-endian) as fp32; 0 where ``mask`` is off."""
    low = tl.load(record_byte_ptr(cache_ptr, blocks, offsets, head, byte, W, stride_block, stride_kv, stride_slot,
                                  stride_head), mask=mask, other=0).to(tl.int32)
    high = tl.load(record_byte_ptr(cache_ptr, blocks, offsets, head, byte + 1, W, stride_block, stride_kv,
                                   stride_slot, stride_head), mask=mask, other=0).to(tl.int32)
    return (low | (high << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_kivi_tile(cache_ptr, table_row, stride_bt_col, head, pos, pos_ok, d, d_ok,
                   stride_block, stride_kv, stride_slot, stride_head,
                   BLOCK_SIZE: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                   VG: tl.constexpr, W: tl.constexpr):
    """Dequantized K and V (fp32 ``[TILE_N, BLOCK_D]``) of one sequence's positions ``pos`` and KV head
    ``head``; zeros where ``pos_ok`` or ``d_ok`` is false (nothing is read there, not even the block table)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    CODE_BYTES: tl.constexpr = D // PER_BYTE
    META_PER_ROW: tl.constexpr = 4 * D // G
    KEY_BYTES: tl.constexpr = CODE_BYTES + META_PER_ROW
    mask = pos_ok[:, None] & d_ok[None, :]
    blocks = tl.load(table_row + (pos // BLOCK_SIZE) * stride_bt_col, mask=pos_ok, other=0).to(tl.int64)[:, None]
    offsets = (pos % BLOCK_SIZE).to(tl.int64)[:, None]
    shift = (BITS * (d % PER_BYTE))[None, :]
    code_byte = (d // PER_BYTE)[None, :]

    k_code = tl.load(record_byte_ptr(cache_ptr, blocks, offsets, head, code_byte, W, stride_block, stride_kv,
                                     stride_slot, stride_head), mask=mask, other=0)
    k_code = ((k_code.to(tl.int32) >> shift) & LEVELS).to(tl.float32)
    # The channel's scale and zero: bytes 2c and 2 D + 2c of its key group's meta, META_PER_ROW of them in each
    # of the group's rows (all in this token's block, from the group's first row on).
    group_offset = offsets // G * G
    meta = 2 * d[None, :]
    k_scale = _fp16_at(cache_ptr, blocks, group_offset + meta // META_PER_ROW, head,
                       CODE_BYTES + meta % META_PER_ROW, mask, W, stride_block, stride_kv, stride_slot, stride_head)
    meta = 2 * D + 2 * d[None, :]
    k_zero = _fp16_at(cache_ptr, blocks, group_offset + meta // META_PER_ROW, head,
                      CODE_BYTES + meta % META_PER_ROW, mask, W, stride_block, stride_kv, stride_slot, stride_head)

    v_code = tl.load(record_byte_ptr(cache_ptr, blocks, offsets, head, KEY_BYTES + code_byte, W, stride_block,
                                     stride_kv, stride_slot, stride_head), mask=mask, other=0)
    v_code = ((v_code.to(tl.int32) >> shift) & LEVELS).to(tl.float32)
    pair = KEY_BYTES + CODE_BYTES + 4 * (d[None, :] // VG)          # the channel group's (scale, zero)
    v_scale = _fp16_at(cache_ptr, blocks, offsets, head, pair, mask, W, stride_block, stride_kv, stride_slot,
                       stride_head)
    v_zero = _fp16_at(cache_ptr, blocks, offsets, head, pair + 2, mask, W, stride_block, stride_kv, stride_slot,
                      stride_head)
    return k_code * k_scale + k_zero, v_code * v_scale + v_zero


@triton.jit
def kivi_paged_attention_kernel(
    out_ptr, query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, cu_query_lens_ptr, tile_map_ptr, open_kv_ptr,
    scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_kv, stride_c_slot, stride_c_head, stride_bt_seq, stride_bt_col,
    stride_f_kv, stride_f_seq, stride_f_pos, stride_f_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    R: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, VG: tl.constexpr, W: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = tl.load(tile_map_ptr + 2 * tile).to(tl.int64)
    q_start = tl.load(tile_map_ptr + 2 * tile + 1)  # first new token of this tile, counted within the sequence
    seq_len = tl.load(seq_lens_ptr + seq)
    first_row = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - first_row
    prefix_len = seq_len - q_len
    open_start = prefix_len // R * R  # open_kv's first position for this sequence

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_start + rows // GROUP_PAD
    heads = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (rows % GROUP_PAD < GROUP) & (tok < q_len)
    q_pos = prefix_len + tok
    q_chunk = q_pos // R * R  # each row: codes below this, full precision from here to q_pos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    token_row = (first_row + tok).to(tl.int64)
    q = tl.load(query_ptr + (token_row * stride_q_tok + heads * stride_q_head)[:, None] + d[None, :],
                mask=io_mask, other=0.0)

    first_pos = prefix_len + q_start
    kv_hi = tl.minimum(first_pos + BLOCK_Q, seq_len)  # one past the tile's last query
    codes_hi = (kv_hi - 1) // R * R                   # the last query's chunk start: all sealed below it
    full_lo = first_pos // R * R                      # the first query's chunk start (>= open_start)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt_seq
    for key_tile in range(0, tl.cdiv(codes_hi, TILE_N)):
        pos = key_tile * TILE_N + tl.arange(0, TILE_N)
        pos_ok = pos < codes_hi
        k, v = load_kivi_tile(cache_ptr, table_row, stride_bt_col, kv_head, pos, pos_ok, d, d_ok,
                              stride_c_block, stride_c_kv, stride_c_slot, stride_c_head,
                              BLOCK_SIZE, HEAD_DIM, G, BITS, VG, W)
        s = attention_scores(q, k.to(q.dtype), scale, 0.0, False, DOT_PRECISION)
        s = tl.where(pos_ok[None, :] & (pos[None, :] < q_chunk[:, None]), s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v.to(q.dtype), DOT_PRECISION)

    full_row = open_kv_ptr + seq * stride_f_seq + kv_head * stride_f_head
    for key_tile in range(full_lo // TILE_N, tl.cdiv(kv_hi, TILE_N)):
        pos = key_tile * TILE_N + tl.arange(0, TILE_N)
        pos_ok = (pos >= full_lo) & (pos < kv_hi)
        ptrs = full_row + ((pos - open_start).to(tl.int64) * stride_f_pos)[:, None] + d[None, :]
        mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(ptrs, mask=mask, other=0.0).to(q.dtype)
        v = tl.load(ptrs + stride_f_kv, mask=mask, other=0.0).to(q.dtype)
        s = attention_scores(q, k, scale, 0.0, False, DOT_PRECISION)
        visible = pos_ok[None, :] & (pos[None, :] >= q_chunk[:, None]) & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

    # A real row sees at least its own key (l_i >= 1); padding rows may see none and are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (token_row * stride_o_tok + heads * stride_o_head)[:, None] + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def kivi_launch_config(num_heads, num_kv_heads, quantizer: KVQuantizer, block_size, dtype, decode: bool,
                       capability=None):
    """Every constexpr of ``kivi_paged_attention_kernel`` and ``num_warps``, from shapes and the device alone.
    Decode: one query token a tile, its query heads padded to 16 rows (``tl.dot``'s least); prefill: 32 rows
    of tokens x heads. Key tiles of 32 positions on a GPU, 16 in the interpreter (whose cost is per op), for
    fp32 and before Ampere, where the prefill tiles and dequantized K/V would spill at 32 (as ptxas builds them
    for sm_75/80/90, tests/kernels/test_gpu_compile.py); fp32 head_dim 256 also gets 16 rows. ``capability``:
    None in the interpreter."""
    bits, group_size = quantizer.kivi
    head_dim = quantizer.head_dim
    group = num_heads // num_kv_heads
    group_pad = max(16, triton.next_power_of_2(group)) if decode else triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    small = capability is None or dtype == torch.float32 or capability < (8, 0)
    rows = 16 if capability is not None and dtype == torch.float32 and block_d >= 256 else 32
    return dict(
        num_warps=8 if block_d >= 128 else 4, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=1 if decode else max(1, rows // group_pad), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE_N=16 if small else 32,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        R=quantizer.residual_length, G=group_size, BITS=bits, VG=kivi_value_group(head_dim, group_size),
        W=quantizer.storage_width,
    )


def kivi_tile_map(num_heads, kv_cache, quantizer: KVQuantizer, cu_query_lens, seq_lens, query_dtype):
    """``query_tile_map`` for the tile ``kivi_paged_attention`` launches (decode when ``cu_query_lens`` is
    None): the same for every layer, so an engine makes it once per step."""
    decode = cu_query_lens is None
    if decode:
        cu_query_lens = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    config = kivi_launch_config(num_heads, kv_cache.shape[3], quantizer, kv_cache.shape[2], query_dtype, decode,
                                _capability(kv_cache.device))
    return query_tile_map(cu_query_lens, seq_lens, config["BLOCK_Q"])


def _capability(device):
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def kivi_paged_attention(query, kv_cache, block_tables, seq_lens, cu_query_lens, open_kv, quantizer: KVQuantizer,
                         scale=None):
    """Attention of each sequence's new tokens over a KIVI cache: codes in the pages, each query's own R-chunk
    from ``open_kv`` (see the module's docstring).

    query ``[T, num_heads, head_dim]`` (fp32 or fp16; bf16 on a GPU), kv_cache uint8 ``[num_blocks, 2,
    block_size, num_kv_heads, W]`` (``quantizer``'s format, whose ``residual_length`` is R) holding every
    sequence's sealed chunks, block_tables int32 ``[S, max_blocks]``, seq_lens int32 ``[S]`` (each >= 1),
    cu_query_lens int32 ``[S + 1]`` (rows of each sequence; None: decode, one query per sequence), open_kv
    float ``[2, S, C, num_kv_heads, head_dim]`` with C at least every sequence's ``seq_len - open_start``.
    Returns a new ``[T, num_heads, head_dim]`` tensor in query's dtype."""
    bits_group = quantizer.kivi if isinstance(quantizer, KVQuantizer) else None
    if bits_group is None or quantizer.residual_length is None:
        raise InvalidArgumentError(f"kivi_paged_attention reads a KIVI cache: quantizer must be a KVQuantizer of a "
                                   f"KIVI format with its residual_length, got {quantizer!r}")
    check_tensor(kv_cache, "kv_cache", ndim=5, dtypes=(torch.uint8,))
    check_kernel_device(kv_cache, "kv_cache")
    num_blocks, _, block_size, num_kv_heads, width = kv_cache.shape
    head_dim, R = quantizer.head_dim, quantizer.residual_length
    if kv_cache.shape[1] != 2 or width != quantizer.storage_width or block_size % R:
        raise InvalidArgumentError(f"a {quantizer.format} cache for head_dim {head_dim} and R {R} is uint8 [blocks, "
                                   f"2, a multiple of {R}, kv heads, {quantizer.storage_width}], got "
                                   f"{tuple(kv_cache.shape)}")
    check_tensor(query, "query", ndim=3, device=kv_cache.device)
    check_cache_dtype(query.dtype, "query")  # bf16 only where it computes right: a GPU with bf16
    num_heads = query.shape[1]
    if query.shape[2] != head_dim or num_heads % num_kv_heads:
        raise InvalidArgumentError(f"query must be [tokens, a multiple of {num_kv_heads} heads, {head_dim}], got "
                                   f"{tuple(query.shape)}")
    scale, _, _ = check_attention_options(scale)
    check_tensor(seq_lens, "seq_lens", ndim=1, device=kv_cache.device)
    num_seqs = seq_lens.shape[0]
    check_seq_lens(seq_lens, num_seqs, device=kv_cache.device, min_len=1)
    check_block_tables(block_tables, num_seqs, num_blocks, seq_lens, block_size)
    if cu_query_lens is None:
        if query.shape[0] != num_seqs:
            raise InvalidArgumentError(f"decode (cu_query_lens None) takes one query per sequence: {num_seqs} "
                                       f"rows, got {query.shape[0]}")
        q_lens = torch.ones_like(seq_lens)
    else:
        check_cu_query_lens(cu_query_lens, num_seqs, query.shape[0], seq_lens)
        q_lens = cu_query_lens[1:] - cu_query_lens[:-1]
    check_tensor(open_kv, "open_kv", ndim=5, dtypes=CACHE_DTYPES, device=kv_cache.device)
    needed = int((seq_lens - (seq_lens - q_lens) // R * R).max()) if num_seqs else 0
    if (open_kv.shape[:2] != (2, num_seqs) or open_kv.shape[2] < needed
            or open_kv.shape[3:] != (num_kv_heads, head_dim)):
        raise InvalidArgumentError(f"open_kv must be [2, {num_seqs}, at least {needed}, {num_kv_heads}, {head_dim}] "
                                   f"(K/V of each sequence from its open chunk's start), got {tuple(open_kv.shape)}")
    tile_map = kivi_tile_map(num_heads, kv_cache, quantizer, cu_query_lens, seq_lens, query.dtype)
    return kivi_paged_attention_unchecked(query, kv_cache, block_tables, seq_lens, cu_query_lens, open_kv, tile_map,
                                          quantizer, scale)


def kivi_paged_attention_unchecked(query, kv_cache, block_tables, seq_lens, cu_query_lens, open_kv, tile_map,
                                   quantizer: KVQuantizer, scale=None):
    """``kivi_paged_attention`` without its checks, for a caller that checked the step once and attends many
    layers with it (the engine): ``tile_map`` is ``kivi_tile_map``'s. Nothing is checked."""
    num_tokens, num_heads, head_dim = query.shape
    decode = cu_query_lens is None
    if decode:
        cu_query_lens = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if tile_map.shape[0] == 0:
        return out
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    config = kivi_launch_config(num_heads, num_kv_heads, quantizer, block_size, query.dtype, decode,
                                _capability(query.device))
    kivi_paged_attention_kernel[(tile_map.shape[0], num_kv_heads)](
        out, query, kv_cache, block_tables, seq_lens, cu_query_lens, tile_map, open_kv,
        head_dim ** -0.5 if scale is None else scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *kv_cache.stride()[:4], block_tables.stride(0), block_tables.stride(1), *open_kv.stride()[:4],
        **config,
    )
    return out


def kivi_attention_triton(query, key, value, kv_cache, step: KiviStep, quantizer: KVQuantizer,
                          window: ResidualWindow, block_tables, seq_lens, cu_query_lens, tile_map, scale=None,
                          checked: bool = False):
    """One layer of a KIVI step with the Triton kernels: ``kvlab.kernels.torch_paged_quant.kivi_attention``'s
    steps, the seal by ``kivi_seal`` and the read by ``kivi_paged_attention`` (``step``: ``plan_kivi_step``'s
    without a torch plan; ``tile_map``: ``kivi_tile_map``'s; ``cu_query_lens`` None: decode). ``checked``:
    the read's checks run on this call too (the engine's debug switch; the seal always checks)."""
    open_kv = kivi_open_chunks(key, value, step, window)
    if step.seal_positions.numel():
        sealed = open_kv[:, step.seal_seqs, step.seal_rows]
        kivi_seal(sealed[0], sealed[1], kv_cache, step.seal_blocks, step.seal_offsets, quantizer)
    kivi_stage(step, window, open_kv)
    if checked:
        return kivi_paged_attention(query, kv_cache, block_tables, seq_lens, cu_query_lens, open_kv, quantizer,
                                    scale)
    return kivi_paged_attention_unchecked(query, kv_cache, block_tables, seq_lens, cu_query_lens, open_kv, tile_map,
                                          quantizer, scale)
