"""Tile helpers shared by the attention kernels (``paged_attention_decode``, ``paged_prefill``).

Both walk a sequence's context in tiles of ``TILE_N`` token positions: ``load_kv_tile`` fetches K and V
through the block table, ``attention_scores`` turns a query tile and a K tile into scores in log2 units, and
``online_softmax_step`` folds one tile of scores and values into a running softmax (fp32, base 2: scores are
pre-multiplied by log2(e) so ``exp2`` does the work).

Every token looks up its own block (``block_table[pos // BLOCK_SIZE]``), so a tile need not line up with
cache blocks: any block size works (1 gives one block per token, 128 several tiles per block), and no tile
shape depends on it. ``tl.dot`` needs at least 16 along every dim, which the launchers guarantee with
``BLOCK_D >= 16`` (head dims from 16 up, padded to a power of two), ``TILE_N >= 16`` and >= 16 query rows.
"""

import triton
import triton.language as tl

import kvlab.device  # noqa: F401  (first: selects the interpreter before any @triton.jit runs)

LOG2E = tl.constexpr(1.4426950408889634)
#: Finite stand-in for -inf as the running max's start value: exp2(-inf - (-inf)) would be NaN for a row
#: whose first tiles are all masked, exp2(-inf - NEG_BIG) is a clean 0.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def soft_cap_scores(s, cap):
    """cap * tanh(s / cap). tl has no tanh; 1 - 2 / (exp(2x) + 1) is exact at both ends (exp -> inf gives 1,
    exp -> 0 gives -1), so large scores saturate instead of overflowing to NaN."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def load_kv_tile(kv_cache_ptr, block_table_row_ptr, stride_bt_col, head_offset, pos, pos_ok, d, d_ok,
                 stride_c_block, stride_c_kv, stride_c_slot, BLOCK_SIZE: tl.constexpr):
    """K and V of the tokens at positions ``pos [TILE_N]`` of one sequence and KV head, each
    ``[TILE_N, BLOCK_D]``; zeros where ``pos_ok`` or ``d_ok`` is false (nothing is read there, not even the
    block table entry)."""
    block_ids = tl.load(block_table_row_ptr + (pos // BLOCK_SIZE) * stride_bt_col, mask=pos_ok, other=0)
    slot = block_ids.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE).to(tl.int64) * stride_c_slot
    ptrs = kv_cache_ptr + (slot + head_offset)[:, None] + d[None, :]
    mask = pos_ok[:, None] & d_ok[None, :]
    k = tl.load(ptrs, mask=mask, other=0.0)
    v = tl.load(ptrs + stride_c_kv, mask=mask, other=0.0)
    return k, v


@triton.jit
def attention_scores(q, k, scale, soft_cap, USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores of ``q [ROWS, BLOCK_D]`` against ``k [TILE_N, BLOCK_D]`` in log2 units, fp32 ``[ROWS, TILE_N]``."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    if USE_SOFT_CAP:
        s = soft_cap_scores(s, soft_cap)
    return s * LOG2E


@triton.jit
def online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of masked scores ``s [ROWS, TILE_N]`` (-inf = hidden) and values ``v [TILE_N, BLOCK_D]``
    into the running max ``m_i``, sum ``l_i`` and unnormalised output ``acc``: everything so far is rescaled
    by exp2(old max - new max), so the result equals a softmax over all tiles at once."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
