"""reshape_and_cache: scatter each new token's K/V into the paged cache slot the block manager chose for it.

The block manager hands out ``slot = block_id * block_size + offset`` per token (``-1`` = skip: the token's
block was dropped by the sliding window, or it is padding). One program copies one token's K and V tile
``[heads, head_dim]``, so tokens never share a program and distinct slots never share a store.
"""

import torch
import triton
import triton.language as tl

from kvlab.device import ON_GPU  # first: selects the Triton interpreter before @triton.jit when there is no GPU
from kvlab.errors import InvalidArgumentError, UnsupportedError
from kvlab.kernels._checks import (CACHE_DTYPES, FP8_CACHE_DTYPES, check_kv_cache, check_kv_scales,
                                   check_slot_mapping, check_tensor)

#: Largest [heads, head_dim] tile one program copies; wider tokens are split over grid axis 1.
#: 4096 keeps a 4-warp program at 32 values per thread per tensor (eight 16-byte fp32 accesses): ptxas needs ~90
#: registers for a [16, 256] fp32 tile where [32, 256] took 160 (5 programs per SM instead of 3), no spills.
MAX_TILE_ELEMENTS = 4096


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
    num_kv_heads, head_dim,
    key_stride_token, key_stride_head, value_stride_token, value_stride_head,
    cache_stride_block, cache_stride_kv, cache_stride_slot, cache_stride_head,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    k_scale_ptr=None, v_scale_ptr=None, FP8: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)                                # [BLOCK_D], padded past head_dim
    slot = tl.load(slot_mapping_ptr + token)                    # int64; -1 = skip this token
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    # A skipped token masks every head. (The interpreter rejects `tensor_mask & scalar_bool`, hence the where.)
    live_heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (heads[:, None] < live_heads) & (dims[None, :] < head_dim)

    key = tl.load(key_ptr + token * key_stride_token + heads[:, None] * key_stride_head + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * value_stride_token + heads[:, None] * value_stride_head + dims[None, :],
                    mask=mask)
    if FP8:  # an fp8 cache: x / scale of its KV head, saturated to the format's largest value (not inf or NaN)
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
        key = tl.clamp(key.to(tl.float32) / k_scale[:, None], -FP8_MAX, FP8_MAX)
        value = tl.clamp(value.to(tl.float32) / v_scale[:, None], -FP8_MAX, FP8_MAX)
    dst = cache_ptr + block * cache_stride_block + offset * cache_stride_slot \
        + heads[:, None] * cache_stride_head + dims[None, :]
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + cache_stride_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_config(num_tokens, num_kv_heads, head_dim, block_size):
    """How ``reshape_and_cache`` launches its kernel (shared with tests/kernels/gpu_compile_variants.py):
    tiles of whole heads up to MAX_TILE_ELEMENTS. Returns ``grid``, ``num_warps`` and the constexprs."""
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, MAX_TILE_ELEMENTS // block_d))
    return dict(grid=(num_tokens, triton.cdiv(num_kv_heads, block_h)), num_warps=4,
                BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_D=block_d)


def reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale=None, v_scale=None):
    """Write ``key``/``value [num_tokens, num_kv_heads, head_dim]`` into ``kv_cache`` at ``slot_mapping``
    (int64 ``[num_tokens]``, -1 = skip). In place; returns ``kv_cache``. Raises InvalidArgumentError (before
    writing anything) on bad shapes, dtypes, devices, out-of-range or duplicate slots.

    An fp8 cache (float8_e4m3fn or float8_e5m2; its torch twin is ``kvlab.kernels.kv_quant``) quantizes on
    write: key / k_scale, saturated, with ``k_scale``/``v_scale`` fp32 ``[num_kv_heads]``; key and value may be
    any float cache dtype. It runs compiled only: the Triton 3.9 interpreter rounds float -> fp8 wrongly when
    rounding carries into the exponent (31.1 becomes 16, not 32), so there it raises UnsupportedError."""
    fp8 = kv_cache.dtype in FP8_CACHE_DTYPES if isinstance(kv_cache, torch.Tensor) else False
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(
        kv_cache, arithmetic=False, storage_dtypes=FP8_CACHE_DTYPES if fp8 else None)
    check_kv_scales(k_scale, v_scale, num_kv_heads, kv_cache, fp8)
    if fp8 and not ON_GPU:
        raise UnsupportedError("reshape_and_cache into an fp8 cache runs compiled on GPUs with fp8 (sm_89+) only: "
                               "the Triton interpreter rounds float -> fp8 wrongly (31.1 becomes 16, not 32); on "
                               "CPU use kvlab.kernels.torch_paged_quant.reshape_and_cache_quantized")
    for name, t in (("key", key), ("value", value)):
        check_tensor(t, name, ndim=3, dtypes=CACHE_DTYPES if fp8 else (kv_cache.dtype,), device=kv_cache.device)
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise InvalidArgumentError(f"{name} has shape {tuple(t.shape)}; it must be [num_tokens, {num_kv_heads}, "
                                       f"{head_dim}] to match the cache's kv heads and head_dim")
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens:
        raise InvalidArgumentError(f"key has {num_tokens} tokens but value has {value.shape[0]}; they must match")
    check_slot_mapping(slot_mapping, num_tokens, num_blocks * block_size, device=kv_cache.device)
    return reshape_and_cache_unchecked(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def reshape_and_cache_unchecked(key, value, kv_cache, slot_mapping, k_scale=None, v_scale=None):
    """``reshape_and_cache`` without its checks, for a caller that checked the step's slots once and writes
    many layers with them (the engine, ``kvlab.kernels.step_checks``): no tensor -> host read. Nothing is
    checked, so a slot out of range writes someone else's memory."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return kv_cache
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    config = reshape_and_cache_config(num_tokens, num_kv_heads, head_dim, block_size)
    reshape_and_cache_kernel[config.pop("grid")](
        key, value, kv_cache, slot_mapping,
        num_kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        **config, **fp8_arguments(kv_cache, k_scale, v_scale),
    )
    return kv_cache


def fp8_arguments(kv_cache, k_scale, v_scale) -> dict:
    """The kernel's fp8 arguments: the scales and the format's largest finite value; none for a float cache."""
    if kv_cache.dtype not in FP8_CACHE_DTYPES:
        return {}
    return dict(k_scale_ptr=k_scale, v_scale_ptr=v_scale, FP8=True, FP8_MAX=torch.finfo(kv_cache.dtype).max)
