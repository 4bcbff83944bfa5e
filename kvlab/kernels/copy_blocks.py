"""Block copies: copy-on-write inside the GPU cache (``copy_blocks``) and swapping to/from host memory
(``swap_blocks``).

copy_blocks does every layer in ONE launch. Layers are separate tensors (``allocate_kv_cache`` returns a
list), so the kernel gets layer 0's cache as its typed base pointer plus an int64 tensor of per-layer
*element offsets* from that base (``(layer.data_ptr() - layer0.data_ptr()) / element_size``). That is the
"table of per-layer base addresses" design without casting integers to pointers: the kernel stays typed,
layers need not be views of one allocation, and it works both compiled (one flat GPU address space) and in
the interpreter, which reads host memory at the addresses it is given (so interpreted caches must live on
the CPU). All layers must share shape, dtype and strides, so one set of strides serves every layer.

swap_blocks has no Triton kernel: a kernel cannot portably read or write host memory, so it moves blocks
with ``Tensor.copy_(non_blocking=True)``, one DMA per run of consecutive (src, dst) blocks.
"""

import torch
import triton
import triton.language as tl

from kvlab.device import ON_GPU  # before any @triton.jit: selects the interpreter when there is no GPU
from kvlab.errors import InvalidArgumentError
from kvlab.kernels._checks import (
    CACHE_DIM_NAMES,
    CACHE_DTYPES,
    check_block_mapping,
    check_kv_cache,
    check_no_overlap,
    check_tensor,
)

#: Largest [heads, head_dim] tile one program copies per token; wider caches split heads over grid axis 2.
#: 4096 keeps a 4-warp program at 32 values per thread (eight 16-byte fp32 accesses): ptxas needs 72 registers
#: for a [16, 256] fp32 tile where [32, 256] took 152-156 (7 programs per SM instead of 3), no spills.
MAX_TILE_ELEMENTS = 4096


@triton.jit
def copy_blocks_kernel(
    cache_ptr,          # layer 0's cache; layer l starts at cache_ptr + layer_offsets[l]
    layer_offsets_ptr,  # int64 [num_layers], in elements
    block_mapping_ptr,  # int64 [num_pairs, 2] (src, dst), contiguous
    num_kv_heads, head_dim,
    stride_block, stride_kv, stride_slot, stride_head,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, LAYER_ALIGN: tl.constexpr,
):
    # grid = (num_pairs, num_layers, 2 * head_chunks): one program copies K or V of one block of one layer.
    pair = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    kv = tl.program_id(2) % 2
    head_chunk = tl.program_id(2) // 2
    layer_offset = tl.multiple_of(tl.load(layer_offsets_ptr + layer), LAYER_ALIGN)
    src_block = tl.load(block_mapping_ptr + 2 * pair)
    dst_block = tl.load(block_mapping_ptr + 2 * pair + 1)

    heads = head_chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    tile = heads[:, None] * stride_head + dims[None, :]          # [BLOCK_H, BLOCK_D] offsets within a slot
    half = cache_ptr + layer_offset + kv * stride_kv             # this layer's K or V half
    src = half + src_block * stride_block + tile
    dst = half + dst_block * stride_block + tile
    for token in range(BLOCK_SIZE):
        values = tl.load(src + token * stride_slot, mask=mask)
        tl.store(dst + token * stride_slot, values, mask=mask)


def _check_layers(kv_caches):
    """All layers look like layer 0 (shape, dtype, device, strides); returns layer 0's cache geometry."""
    if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, (list, tuple)) or len(kv_caches) == 0:
        raise InvalidArgumentError("kv_caches must be a non-empty list of per-layer cache tensors "
                                   "[num_blocks, 2, block_size, num_kv_heads, head_dim]")
    geometry = check_kv_cache(kv_caches[0], "kv_caches[0]", arithmetic=False)
    first = kv_caches[0]
    for i, layer in enumerate(kv_caches[1:], start=1):
        check_tensor(layer, f"kv_caches[{i}]", dtypes=(first.dtype,), device=first.device)
        if layer.shape != first.shape or layer.stride() != first.stride():
            raise InvalidArgumentError(
                f"kv_caches[{i}] has shape {tuple(layer.shape)} and strides {layer.stride()}, but kv_caches[0] has "
                f"{tuple(first.shape)} and {first.stride()}; all layers must share shape and strides")
    if not ON_GPU and first.device.type != "cpu":
        raise InvalidArgumentError(f"kv_caches are on {first.device}, but without a compiled GPU build the "
                                   "interpreter addresses layers in host memory: use CPU caches")
    return geometry


def _layer_offsets(kv_caches):
    """int64 element offsets of every layer from layer 0, and the largest power of two (<= 16) dividing them all,
    which lets the compiler keep vectorised loads."""
    element_size = kv_caches[0].element_size()
    base = kv_caches[0].data_ptr()
    offsets = [(layer.data_ptr() - base) // element_size for layer in kv_caches]
    align = 16
    while align > 1 and any(offset % align for offset in offsets):
        align //= 2
    return torch.tensor(offsets, dtype=torch.int64, device=kv_caches[0].device), align


def copy_blocks_config(num_pairs, num_layers, num_kv_heads, head_dim, block_size, layer_align):
    """How ``copy_blocks`` launches its kernel (shared with tests/kernels/gpu_compile_variants.py): grid
    (pairs, layers, K/V x head chunks), tiles of whole heads up to MAX_TILE_ELEMENTS. ``layer_align`` comes
    from ``_layer_offsets``. Returns ``grid``, ``num_warps`` and the constexprs."""
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, MAX_TILE_ELEMENTS // block_d))
    return dict(grid=(num_pairs, num_layers, 2 * triton.cdiv(num_kv_heads, block_h)), num_warps=4,
                BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_D=block_d, LAYER_ALIGN=layer_align)


def copy_blocks(kv_caches, block_mapping):
    """Copy-on-write for every layer at once: block dst becomes a copy of block src for each (src, dst) pair
    of ``block_mapping`` (list of pairs or int tensor ``[n, 2]``, e.g. from ``BlockManager.append_slots``).
    In place; returns ``kv_caches``. No dst may repeat and no block may be both a src and a dst (the copies
    run in parallel); on bad input raises InvalidArgumentError before copying anything."""
    num_blocks, block_size, num_kv_heads, head_dim = _check_layers(kv_caches)
    first = kv_caches[0]
    pairs = check_block_mapping(block_mapping, num_blocks, num_blocks, device=first.device, same_cache=True)
    if pairs.shape[0] == 0:
        return kv_caches
    layer_offsets, layer_align = _layer_offsets(kv_caches)

    config = copy_blocks_config(pairs.shape[0], len(kv_caches), num_kv_heads, head_dim, block_size, layer_align)
    copy_blocks_kernel[config.pop("grid")](
        first, layer_offsets, pairs.contiguous(),
        num_kv_heads, head_dim,
        first.stride(0), first.stride(1), first.stride(2), first.stride(3),
        **config,
    )
    return kv_caches


def _runs(pairs):
    """Split (src, dst) pairs into runs ``(src_start, dst_start, length)`` where both ids go up by one, so each
    run is a single slice copy (one DMA when the caches are contiguous)."""
    pairs = pairs[torch.argsort(pairs[:, 0])].tolist()
    runs = []
    for src, dst in pairs:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return runs


def swap_blocks(src, dst, block_mapping):
    """Block d of ``dst`` becomes a copy of block s of ``src`` for each (s, d) pair; the caches may be on
    different devices (GPU -> CPU to swap out, CPU -> GPU to swap in). Returns ``dst``.

    Copies are queued asynchronously on the current CUDA stream. When ``dst`` is in host memory this waits
    for them, so the caller can read ``dst`` at once; copies into a GPU ``dst`` stay queued, and every later
    kernel on the stream sees them. On bad input (shapes, dtypes, meta or overlapping caches, the mapping)
    raises InvalidArgumentError before copying anything.
    """
    check_tensor(src, "src", ndim=5, dtypes=CACHE_DTYPES)
    check_tensor(dst, "dst", ndim=5, dtypes=(src.dtype,))
    if src.shape[1:] != dst.shape[1:] or src.shape[1] != 2:
        raise InvalidArgumentError(
            f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must both be [num_blocks, 2, block_size, "
            "num_kv_heads, head_dim] caches with the same block shape")
    for cache, name in ((src, "src"), (dst, "dst")):
        check_no_overlap(cache, name, CACHE_DIM_NAMES)
    if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr() and src.device == dst.device:
        raise InvalidArgumentError("src and dst share memory; swap_blocks moves blocks between two caches "
                                   "(use copy_blocks for copies inside one cache)")
    pairs = check_block_mapping(block_mapping, src.shape[0], dst.shape[0], device="cpu", same_cache=False)
    for src_start, dst_start, length in _runs(pairs):
        dst[dst_start:dst_start + length].copy_(src[src_start:src_start + length], non_blocking=True)
    if src.device.type == "cuda" and dst.device.type == "cpu":
        torch.cuda.current_stream(src.device).synchronize()
    return dst
