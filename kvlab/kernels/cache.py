"""Allocating paged KV caches: one ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` tensor per layer
(MLA's latent caches: ``[num_blocks, block_size, latent_dim]``).

Memory comes from ``torch.empty`` on purpose: a fresh cache holds garbage, exactly as on a real server, so
tests can poison it (fill with NaN) and prove a kernel only touched the slots it was told to.

Sizes are only checked to be positive ints (a budget may be planned for any shape); the kernels take block
sizes ``_checks.SUPPORTED_BLOCK_SIZES`` (powers of two, 1 to 128) and head dims 16 to 256.
"""

import torch

from kvlab.errors import InvalidArgumentError
from kvlab.kernels._checks import CACHE_DTYPES
from kvlab.kernels.kv_quant import STORAGE_DTYPES
from kvlab.validation import check_int


def _positive_ints(**values):
    """The values, each checked to be an int >= 1 (NumPy ints become ``int``), in the order given."""
    return [check_int(name, value, 1) for name, value in values.items()]


def _check_dtype(dtype):
    """A float cache dtype, or a quantized cache's storage (uint8, fp8: ``kvlab.kernels.kv_quant``)."""
    if dtype not in CACHE_DTYPES + STORAGE_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in CACHE_DTYPES + STORAGE_DTYPES)
        raise InvalidArgumentError(f"dtype {dtype} is not a cache dtype; allowed: {names}")


def bytes_per_block(num_layers, num_kv_heads, head_dim, *, block_size=16, dtype) -> int:
    """Bytes one block id costs across the whole model: K and V for ``block_size`` tokens in every layer."""
    num_layers, num_kv_heads, head_dim, block_size = _positive_ints(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    _check_dtype(dtype)
    element_size = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element_size


def num_blocks_for_budget(num_layers, num_kv_heads, head_dim, *, block_size=16, dtype, memory_budget_bytes) -> int:
    """How many blocks fit in ``memory_budget_bytes`` for this model shape (rounded down, may be 0)."""
    memory_budget_bytes = check_int("memory_budget_bytes", memory_budget_bytes, 0)
    per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size=block_size, dtype=dtype)
    return memory_budget_bytes // per_block


def _resolve_num_blocks(num_layers, num_kv_heads, head_dim, block_size, dtype, memory_budget_bytes, num_blocks):
    if (memory_budget_bytes is None) == (num_blocks is None):
        raise InvalidArgumentError("pass exactly one of num_blocks and memory_budget_bytes")
    if num_blocks is None:
        num_blocks = num_blocks_for_budget(num_layers, num_kv_heads, head_dim, block_size=block_size, dtype=dtype,
                                           memory_budget_bytes=memory_budget_bytes)
        if num_blocks == 0:
            per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size=block_size, dtype=dtype)
            raise InvalidArgumentError(f"memory_budget_bytes={memory_budget_bytes} holds no block; one block "
                                       f"needs {per_block} bytes for this model shape")
    return check_int("num_blocks", num_blocks, 1)


def allocate_kv_cache(num_layers, num_kv_heads, head_dim, *, block_size=16, dtype, device, memory_budget_bytes=None,
                      num_blocks=None) -> list:
    """One uninitialised cache tensor per layer, each ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.

    Give either ``num_blocks`` or ``memory_budget_bytes`` (then as many blocks as fit, counting all layers).
    """
    num_layers, num_kv_heads, head_dim, block_size = _positive_ints(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    _check_dtype(dtype)
    num_blocks = _resolve_num_blocks(num_layers, num_kv_heads, head_dim, block_size, dtype, memory_budget_bytes,
                                     num_blocks)
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    return [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def allocate_cpu_cache(num_layers, num_kv_heads, head_dim, *, num_blocks, block_size=16, dtype,
                       pin_memory=None) -> list:
    """Host-side caches for swapping, same layout as ``allocate_kv_cache``.

    ``pin_memory`` (default: whenever CUDA is available) page-locks the host memory so that GPU<->CPU copies
    are real asynchronous DMA; pageable memory would make every swap a synchronous staged copy.
    """
    num_layers, num_kv_heads, head_dim, block_size, num_blocks = _positive_ints(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        num_blocks=num_blocks)
    _check_dtype(dtype)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    if pin_memory and not torch.cuda.is_available():
        raise InvalidArgumentError("pin_memory=True needs CUDA (pinned memory is for GPU DMA); pass pin_memory=False")
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    return [torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin_memory) for _ in range(num_layers)]


def allocate_latent_cache(num_layers, latent_dim, *, num_blocks, block_size=16, dtype, device,
                          pin_memory=False) -> list:
    """MLA (``kvlab.kernels.mla_decode``): one uninitialised ``[num_blocks, block_size, latent_dim]`` tensor per
    layer, a row per token (compressed KV, then the rotated key part; no separate V). ``pin_memory``: page-lock
    host memory, as ``allocate_cpu_cache`` does for swapping."""
    num_layers, latent_dim, block_size, num_blocks = _positive_ints(
        num_layers=num_layers, latent_dim=latent_dim, block_size=block_size, num_blocks=num_blocks)
    _check_dtype(dtype)
    return [torch.empty(num_blocks, block_size, latent_dim, dtype=dtype, device=device, pin_memory=pin_memory)
            for _ in range(num_layers)]
