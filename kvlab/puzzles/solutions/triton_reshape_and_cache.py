"""A solution of kvlab.puzzles.triton_reshape_and_cache."""

import kvlab.device  # noqa: F401 - first: it selects Triton's interpreter on a CPU, before triton loads
import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, num_heads, head_dim, block_size,
                             stride_block, stride_kv, stride_slot, stride_head,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:  # -1: a padding token, nothing to write
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_heads) & (dims < head_dim)
        row = t * num_heads * head_dim + heads * head_dim + dims  # key and value are contiguous [T, H, D]
        dst = cache_ptr + (slot // block_size) * stride_block + (slot % block_size) * stride_slot \
            + heads * stride_head + dims
        tl.store(dst, tl.load(key_ptr + row, mask=mask), mask=mask)
        tl.store(dst + stride_kv, tl.load(value_ptr + row, mask=mask), mask=mask)
