"""Cache allocation: sizes from a memory budget, layout, and refusals."""

import numpy as np
import pytest
import torch

from kvlab.device import DEVICE
from kvlab.errors import InvalidArgumentError
from kvlab.kernels.cache import allocate_cpu_cache, allocate_kv_cache, bytes_per_block, num_blocks_for_budget
from kvlab.kernels.reference import reshape_and_cache_ref
from kvlab.kernels.reshape_and_cache import reshape_and_cache


def test_bytes_per_block_counts_k_and_v_in_every_layer():
    # 32 layers x (K + V) x 16 tokens x 8 kv heads x 128 dims x 2 bytes = 2 MiB per block id
    assert bytes_per_block(32, 8, 128, block_size=16, dtype=torch.float16) == 32 * 2 * 16 * 8 * 128 * 2
    assert bytes_per_block(1, 3, 80, block_size=8, dtype=torch.float32) == 2 * 8 * 3 * 80 * 4


def test_num_blocks_for_budget_rounds_down():
    per_block = bytes_per_block(2, 4, 64, block_size=16, dtype=torch.bfloat16)
    kwargs = dict(block_size=16, dtype=torch.bfloat16)
    assert num_blocks_for_budget(2, 4, 64, memory_budget_bytes=7 * per_block + per_block - 1, **kwargs) == 7
    assert num_blocks_for_budget(2, 4, 64, memory_budget_bytes=per_block - 1, **kwargs) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_allocate_kv_cache_gives_one_tensor_per_layer(dtype):
    caches = allocate_kv_cache(3, 2, 80, block_size=8, dtype=dtype, device=DEVICE, num_blocks=5)
    assert len(caches) == 3
    for cache in caches:
        assert cache.shape == (5, 2, 8, 2, 80) and cache.dtype == dtype and cache.device.type == DEVICE.type
        assert cache.is_contiguous()
    assert len({cache.data_ptr() for cache in caches}) == 3  # separate memory per layer


def test_allocate_kv_cache_from_a_budget_fills_it():
    per_block = bytes_per_block(2, 2, 64, block_size=16, dtype=torch.float16)
    caches = allocate_kv_cache(2, 2, 64, dtype=torch.float16, device=DEVICE, memory_budget_bytes=10 * per_block + 5)
    assert [cache.shape[0] for cache in caches] == [10, 10]
    assert sum(cache.numel() * cache.element_size() for cache in caches) == 10 * per_block


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one of num_blocks and memory_budget_bytes"),
    ({"num_blocks": 4, "memory_budget_bytes": 1 << 20}, "exactly one"),
    ({"memory_budget_bytes": 100}, "holds no block; one block needs 8192 bytes"),
    ({"memory_budget_bytes": -1}, "memory_budget_bytes must be an int >= 0"),
    ({"memory_budget_bytes": 1e9}, "memory_budget_bytes must be an int >= 0, got 1000000000.0"),
    ({"num_blocks": 0}, "num_blocks must be an int >= 1, got 0"),
    ({"num_blocks": 4.0}, "num_blocks must be an int >= 1, got 4.0"),
    ({"num_blocks": True}, "num_blocks must be an int >= 1, got True"),
    ({"num_blocks": 4, "dtype": torch.int8}, "not a cache dtype"),
    ({"num_blocks": 4, "block_size": 0}, "block_size must be an int >= 1, got 0"),
])
def test_allocate_kv_cache_rejects(kwargs, match):
    kwargs = {"dtype": torch.float16, "device": DEVICE, **kwargs}
    with pytest.raises(InvalidArgumentError, match=match):
        allocate_kv_cache(1, 2, 64, **kwargs)


def test_numpy_ints_are_sizes_too():
    (cache,) = allocate_kv_cache(np.int64(1), np.int32(3), np.int64(16), block_size=np.int64(4), dtype=torch.float32,
                                 device=DEVICE, num_blocks=np.int64(2))
    assert cache.shape == (2, 2, 4, 3, 16)
    budget = np.int64(2 * 1536 + 5)  # 1536 bytes a block
    assert num_blocks_for_budget(1, 3, 16, block_size=4, dtype=torch.float32, memory_budget_bytes=budget) == 2


@pytest.mark.parametrize("block_size, head_dim", [(1, 16), (128, 256)])
def test_caches_at_the_ends_of_the_supported_sizes_take_kernel_writes(randn, assert_bitwise_equal, block_size,
                                                                     head_dim):
    (cache,) = allocate_kv_cache(1, 1, head_dim, block_size=block_size, dtype=torch.float16, device=DEVICE,
                                 num_blocks=3)
    cache.fill_(float("nan"))
    expected = cache.clone()
    key, value = randn(2, 1, head_dim, dtype=torch.float16), randn(2, 1, head_dim, dtype=torch.float16)
    slots = torch.tensor([2, 0], device=DEVICE)
    reshape_and_cache(key, value, cache, slots)
    assert_bitwise_equal(cache, reshape_and_cache_ref(key, value, expected, slots))


def test_allocate_cpu_cache_lives_on_the_host_pinned_when_cuda_exists():
    caches = allocate_cpu_cache(2, 2, 64, num_blocks=3, dtype=torch.float16)
    assert [cache.shape for cache in caches] == [(3, 2, 16, 2, 64)] * 2
    assert all(cache.device.type == "cpu" and cache.is_pinned() == torch.cuda.is_available() for cache in caches)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning is possible with CUDA")
def test_allocate_cpu_cache_refuses_pinning_without_cuda():
    with pytest.raises(InvalidArgumentError, match="pin_memory=True needs CUDA"):
        allocate_cpu_cache(1, 2, 64, num_blocks=3, dtype=torch.float16, pin_memory=True)
