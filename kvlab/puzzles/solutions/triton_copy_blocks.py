"""A solution of kvlab.puzzles.triton_copy_blocks."""

import kvlab.device  # noqa: F401 - first: it selects Triton's interpreter on a CPU, before triton loads
import triton
import triton.language as tl


@triton.jit
def copy_blocks_kernel(cache_ptr, block_mapping_ptr, num_heads, head_dim, block_size,
                       stride_block, stride_kv, stride_slot, stride_head,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pair, kv = tl.program_id(0), tl.program_id(1)
    src = tl.load(block_mapping_ptr + 2 * pair)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    tile = kv * stride_kv + heads * stride_head + dims  # one slot's [H, D], K or V
    for offset in range(block_size):
        values = tl.load(cache_ptr + src * stride_block + offset * stride_slot + tile, mask=mask)
        tl.store(cache_ptr + dst * stride_block + offset * stride_slot + tile, values, mask=mask)
