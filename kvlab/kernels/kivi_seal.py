"""KIVI's write in Triton: ``kivi_seal`` quantizes whole key groups of K/V into a KIVI cache's pages, the step
``kvlab.kernels.torch_paged_quant.kivi_attention`` takes when a chunk leaves the window (its torch twin is
``KVQuantizer.encode`` followed by the indexed store there).

One program per (key group of G tokens, KV head, chunk of channels: ``kivi_seal_config``; any head_dim, the
last chunk masked). Keys: per channel, min and max over the group's G rows give an fp16 zero and scale (scale =
(max - min) / (2^b - 1), at least ``MIN_SCALE``); each row's code bytes pack 8 / b neighbouring channels; the
group's [scales (D), zeros (D)] fp16 bytes go 4 D / G to a row. Values: per row and group of ``gcd(D, G)``
channels, the same min / max code, and the group's (scale, zero) fp16 pair after the row's code bytes. Codes
round half to even, as torch's ``round``. A record of ``k_bytes + v_bytes`` bytes is split over the cache's K
and V halves at W (``KVQuantizer``), so every byte's address says which half it is in. Every load and store
is masked: nothing outside the given slots is read or written.
"""

import torch
import triton
import triton.language as tl

from kvlab.device import ON_GPU  # noqa: F401  (before any @triton.jit: selects the interpreter without a GPU)
from kvlab.errors import InvalidArgumentError
from kvlab.kernels.kv_quant import MIN_SCALE, KVQuantizer
from kvlab.sizing.kv_dtypes import kivi_value_group

FP16_MAX = 65504.0


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def record_byte_ptr(cache_ptr, blocks, offsets, head, byte, W, stride_block, stride_kv, stride_slot, stride_head):
    """Address of record byte ``byte`` of the token in slot (blocks, offsets), KV head ``head``."""
    half = (byte >= W).to(tl.int64)
    return (cache_ptr + blocks * stride_block + half * stride_kv + offsets * stride_slot + head * stride_head
            + byte - half * W)


@triton.jit
def _fp16_bytes(x):
    """fp32 values exactly representable in fp16 -> (low byte, high byte) of their fp16 bits."""
    bits = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (bits & 0xFF).to(tl.uint8), (bits >> 8).to(tl.uint8)


@triton.jit
def _zero_scale(mn, mx, LEVELS: tl.constexpr, MIN_SCALE_: tl.constexpr, FP16_MAX_: tl.constexpr):
    zero = tl.minimum(tl.maximum(mn, -FP16_MAX_), FP16_MAX_).to(tl.float16).to(tl.float32)
    scale = tl.minimum(tl.maximum((mx - zero) / LEVELS, MIN_SCALE_), FP16_MAX_).to(tl.float16).to(tl.float32)
    return zero, scale


@triton.jit
def _store_codes(codes, cache_ptr, blocks, offsets, head, first_byte, chunk, rows, W, stride_block, stride_kv,
                 stride_slot, stride_head, G: tl.constexpr, CHUNK: tl.constexpr, BITS: tl.constexpr,
                 CODE_BYTES: tl.constexpr):
    """Store codes ``[G, CHUNK]`` of channels ``chunk * CHUNK ..``: channel c at bits BITS (c mod 8 / BITS) of
    the row's byte ``first_byte + c // (8 / BITS)`` (disjoint bits: a sum is an or)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    shifts = BITS * tl.arange(0, PER_BYTE)
    packed = tl.sum(tl.reshape(codes.to(tl.int32), (G, CHUNK // PER_BYTE, PER_BYTE)) << shifts[None, None, :], 2)
    byte = chunk * (CHUNK // PER_BYTE) + tl.arange(0, CHUNK // PER_BYTE)
    ptr = record_byte_ptr(cache_ptr, blocks, offsets, head, first_byte + byte[None, :], W, stride_block, stride_kv,
                          stride_slot, stride_head)
    tl.store(ptr, packed.to(tl.uint8), mask=(rows[:, None] >= 0) & (byte < CODE_BYTES)[None, :])


@triton.jit
def kivi_seal_kernel(
    key_ptr, value_ptr,        # fp32 [N, H, D] contiguous: N = groups x G rows, group g = rows gG .. gG + G - 1
    blocks_ptr, offsets_ptr,   # int64 [N]: each row's slot
    cache_ptr,                 # uint8 [num_blocks, 2, block_size, H, W]
    num_heads,
    stride_block, stride_kv, stride_slot, stride_head,
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, VG: tl.constexpr, W: tl.constexpr, CHUNK: tl.constexpr,
    MIN_SCALE_: tl.constexpr, FP16_MAX_: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    PER_BYTE: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    CODE_BYTES: tl.constexpr = D // PER_BYTE
    META_PER_ROW: tl.constexpr = 4 * D // G
    KEY_BYTES: tl.constexpr = CODE_BYTES + META_PER_ROW
    VALUE_GROUPS: tl.constexpr = CHUNK // VG                                 # whole value groups in a chunk
    rows = group * G + tl.arange(0, G)                                        # [G]
    blocks = tl.load(blocks_ptr + rows)[:, None]
    offsets = tl.load(offsets_ptr + rows)[:, None]
    channel = chunk * CHUNK + tl.arange(0, CHUNK)                            # [CHUNK]; past D: padding
    channel_ok = channel < D
    tile_ok = (rows[:, None] >= 0) & channel_ok[None, :]                     # [G, CHUNK]
    element = rows[:, None] * num_heads * D + head * D + channel[None, :]

    # Keys: per channel over the group's rows; the channel's fp16 scale (group meta bytes 2c, 2c + 1) and zero
    # (2 D + 2c, 2 D + 2c + 1) go META_PER_ROW bytes to a row of the group, after its code bytes.
    x = tl.load(key_ptr + element, mask=tile_ok, other=0.0)
    zero, scale = _zero_scale(tl.min(x, 0), tl.max(x, 0), LEVELS, MIN_SCALE_, FP16_MAX_)  # [CHUNK]
    key_codes = tl.minimum(tl.maximum(_round_half_even((x - zero[None, :]) / scale[None, :]), 0.0), LEVELS)
    _store_codes(key_codes, cache_ptr, blocks, offsets, head, 0, chunk, rows, W, stride_block, stride_kv,
                 stride_slot, stride_head, G, CHUNK, BITS, CODE_BYTES)
    for part in tl.static_range(2):
        low, high = _fp16_bytes(scale if part == 0 else zero)
        for k in tl.static_range(2):
            meta = part * 2 * D + 2 * channel + k
            meta_row = group * G + meta // META_PER_ROW
            ptr = record_byte_ptr(cache_ptr, tl.load(blocks_ptr + meta_row, mask=channel_ok, other=0),
                                  tl.load(offsets_ptr + meta_row, mask=channel_ok, other=0), head,
                                  CODE_BYTES + meta % META_PER_ROW, W, stride_block, stride_kv, stride_slot,
                                  stride_head)
            tl.store(ptr, low if k == 0 else high, mask=channel_ok)

    # Values: per row over each group of VG channels (a chunk holds whole groups); the group's (scale, zero)
    # pair after the row's value codes.
    xs = tl.reshape(tl.load(value_ptr + element, mask=tile_ok, other=0.0), (G, VALUE_GROUPS, VG))
    vzero, vscale = _zero_scale(tl.min(xs, 2), tl.max(xs, 2), LEVELS, MIN_SCALE_, FP16_MAX_)  # [G, groups]
    value_codes = tl.minimum(tl.maximum(_round_half_even((xs - vzero[:, :, None]) / vscale[:, :, None]), 0.0),
                             LEVELS)
    _store_codes(tl.reshape(value_codes, (G, CHUNK)), cache_ptr, blocks, offsets, head, KEY_BYTES, chunk, rows, W,
                 stride_block, stride_kv, stride_slot, stride_head, G, CHUNK, BITS, CODE_BYTES)
    value_group = chunk * VALUE_GROUPS + tl.arange(0, VALUE_GROUPS)
    group_ok = (rows[:, None] >= 0) & (value_group * VG < D)[None, :]
    for part in tl.static_range(2):
        low, high = _fp16_bytes(vscale if part == 0 else vzero)
        for k in tl.static_range(2):
            byte = KEY_BYTES + CODE_BYTES + 4 * value_group[None, :] + 2 * part + k
            ptr = record_byte_ptr(cache_ptr, blocks, offsets, head, byte, W, stride_block, stride_kv,
                                  stride_slot, stride_head)
            tl.store(ptr, low if k == 0 else high, mask=group_ok)


def kivi_seal_config(head_dim: int, group: int) -> dict:
    """The launch's channel chunk and warps: a program quantizes one key group of one KV head, ``CHUNK``
    channels of it (whole value groups, at least 32: a power of two), so no tile outgrows the registers at
    G 128 and head_dim 256 (ptxas, tests/kernels/test_gpu_compile.py); grid ``(N / G, H, cdiv(D, CHUNK))``."""
    chunk = max(kivi_value_group(head_dim, group), 32)
    elements = group * chunk  # a [G, CHUNK] tile: at most 32 of them a thread
    return dict(CHUNK=chunk, num_warps=16 if elements >= 16384 else 8 if elements >= 4096 else 4)


def kivi_seal(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor,
              offsets: torch.Tensor, quantizer: KVQuantizer) -> torch.Tensor:
    """Quantize ``key``/``value [N, H, D]`` (N whole key groups, in position order) into the slots ``blocks`` /
    ``offsets [N]`` of the KIVI cache ``kv_cache`` (uint8 ``[num_blocks, 2, block_size, H, W]``). Returns kv_cache."""
    if quantizer.kivi is None:
        raise InvalidArgumentError(f"kivi_seal writes a KIVI cache; the quantizer's format is {quantizer.format!r}")
    bits, group = quantizer.kivi
    n, heads, d = key.shape
    if (value.shape != key.shape or d != quantizer.head_dim or n % group or kv_cache.dtype != torch.uint8
            or kv_cache.shape[3] != heads or kv_cache.shape[4] != quantizer.storage_width
            or blocks.shape != (n,) or offsets.shape != (n,)):
        raise InvalidArgumentError(
            f"kivi_seal takes key and value [N, H, {quantizer.head_dim}] with N a multiple of {group}, blocks and "
            f"offsets [N], and a uint8 cache [blocks, 2, block_size, H, {quantizer.storage_width}]; got "
            f"{tuple(key.shape)}, {tuple(value.shape)}, {tuple(blocks.shape)}, {tuple(offsets.shape)} and "
            f"{kv_cache.dtype} {tuple(kv_cache.shape)}")
    if n == 0:
        return kv_cache
    config = kivi_seal_config(d, group)
    kivi_seal_kernel[(n // group, heads, triton.cdiv(d, config["CHUNK"]))](
        key.float().contiguous(), value.float().contiguous(), blocks.long().contiguous(), offsets.long().contiguous(),
        kv_cache, heads, *kv_cache.stride()[:4], D=d, G=group, BITS=bits, VG=kivi_value_group(d, group),
        W=quantizer.storage_width, MIN_SCALE_=MIN_SCALE, FP16_MAX_=FP16_MAX, **config)
    return kv_cache
