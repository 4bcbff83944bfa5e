"""copy_blocks (every layer in one launch) and swap_blocks against the reference, bit for bit; bad input raises
before anything is copied."""

import importlib

import pytest
import torch

from kvlab.device import DEVICE, ON_GPU
from kvlab.errors import InvalidArgumentError
from kvlab.kernels.cache import allocate_cpu_cache, allocate_kv_cache
from kvlab.kernels.copy_blocks import copy_blocks, swap_blocks
from kvlab.reference import copy_blocks_ref, swap_blocks_ref

module = importlib.import_module("kvlab.kernels.copy_blocks")  # the module; kvlab.kernels.copy_blocks is the function

# Pure copies: bf16 bits move exactly in the interpreter.
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(ON_GPU and not torch.cuda.is_bf16_supported(),
                                                             reason="this GPU has no bf16"))
DTYPES = [torch.float32, torch.float16, BF16]


def poisoned_layers(make_cache, randn, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, layout):
    """Layers holding random values, except block 0 of every layer, which keeps its NaN poison (a partially
    filled block's unused slots are garbage too, and copies must carry them over unchanged)."""
    layers = []
    for _ in range(num_layers):
        cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, layout)
        cache[1:] = randn(num_blocks - 1, 2, block_size, num_kv_heads, head_dim, dtype=dtype)
        layers.append(cache)
    return layers


def copy_and_compare(layers, mapping, assert_bitwise_equal):
    expected = [layer.clone() for layer in layers]
    assert copy_blocks(layers, mapping) is layers
    copy_blocks_ref(expected, mapping)
    for layer, reference in zip(layers, expected):
        assert_bitwise_equal(layer, reference)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("layout", ["contiguous", "padded", "kv_major"])
@pytest.mark.parametrize("block_size, head_dim", [(8, 80), (16, 64), (32, 128)])
def test_copy_blocks_matches_reference(make_cache, randn, assert_bitwise_equal, dtype, layout, block_size, head_dim):
    layers = poisoned_layers(make_cache, randn, 3, 7, block_size, 3, head_dim, dtype, layout)
    copy_and_compare(layers, [(5, 2), (0, 6), (3, 1)], assert_bitwise_equal)  # (0, 6): block 6 becomes NaN


@pytest.mark.parametrize("mapping_type", [torch.int32, torch.int64, list], ids=["int32", "int64", "list"])
def test_copy_blocks_accepts_pairs_as_tensor_or_list(make_cache, randn, assert_bitwise_equal, mapping_type):
    layers = poisoned_layers(make_cache, randn, 2, 9, 8, 2, 64, torch.float16, "contiguous")
    pairs = torch.randperm(9)[:8].view(4, 2)  # shuffled, disjoint srcs and dsts
    mapping = pairs.tolist() if mapping_type is list else pairs.to(DEVICE, mapping_type)
    copy_and_compare(layers, mapping, assert_bitwise_equal)


def test_copy_blocks_on_views_of_one_stacked_tensor(randn, assert_bitwise_equal):
    stacked = randn(4, 6, 2, 16, 2, 80)  # [layers, blocks, 2, block_size, heads, dim]: one allocation
    copy_and_compare(list(stacked.unbind(0)), [(1, 4), (2, 0)], assert_bitwise_equal)


def test_copy_blocks_on_allocated_caches(assert_bitwise_equal):
    layers = allocate_kv_cache(5, 2, 96, block_size=8, dtype=torch.float16, device=DEVICE, num_blocks=4)
    for layer in layers:
        layer.copy_(torch.randn(layer.shape))
    copy_and_compare(layers, [(3, 0)], assert_bitwise_equal)


def test_copy_blocks_splits_wide_heads_over_programs(make_cache, randn, assert_bitwise_equal, monkeypatch):
    monkeypatch.setattr(module, "MAX_TILE_ELEMENTS", 64)  # one head per program, 5 programs per K or V
    layers = poisoned_layers(make_cache, randn, 2, 4, 8, 5, 80, torch.float32, "padded")
    copy_and_compare(layers, [(2, 3), (1, 0)], assert_bitwise_equal)


def test_copy_blocks_with_no_pairs_is_a_no_op(make_cache, randn, assert_bitwise_equal):
    layers = poisoned_layers(make_cache, randn, 2, 3, 8, 2, 64, torch.float32, "contiguous")
    copy_and_compare(layers, [], assert_bitwise_equal)


COPY_ERRORS = {
    "dst repeated": ([(1, 2), (3, 2)], "dst block 2 appears more than once"),
    "src is a dst": ([(1, 2), (2, 3)], "block 2 is both a src and a dst"),
    "src out of range": ([(4, 2)], r"src block 4; src ids must be in \[0, 4\)"),
    "negative dst": ([(1, -1)], r"dst block -1"),
    "bad mapping shape": (torch.tensor([[1, 2, 3]]), r"int32/int64 \[n, 2\] tensor"),
}


@pytest.mark.parametrize("name", list(COPY_ERRORS))
def test_copy_blocks_rejects_bad_mappings_and_copies_nothing(make_cache, randn, assert_bitwise_equal, name):
    mapping, match = COPY_ERRORS[name]
    layers = poisoned_layers(make_cache, randn, 2, 4, 8, 2, 64, torch.float32, "contiguous")
    before = [layer.clone() for layer in layers]
    with pytest.raises(InvalidArgumentError, match=match):
        copy_blocks(layers, mapping)
    for layer, unchanged in zip(layers, before):
        assert_bitwise_equal(layer, unchanged)


def test_copy_blocks_rejects_mismatched_layers(make_cache):
    good = make_cache(4, 8, 2, 64, torch.float32)
    cases = [
        ([], "non-empty list"),
        (good, "non-empty list"),
        ([good, make_cache(5, 8, 2, 64, torch.float32)], r"kv_caches\[1\] has shape \(5, 2, 8, 2, 64\)"),
        ([good, make_cache(4, 8, 2, 64, torch.float32, "padded")], "all layers must share shape and strides"),
        ([good, make_cache(4, 8, 2, 64, torch.float16)], r"kv_caches\[1\] has dtype float16"),
        ([good, good.to("meta")], r"kv_caches\[1\] is on meta"),
        ([make_cache(4, 8, 2, 72, torch.float32)], "head_dim 72"),
    ]
    for layers, match in cases:
        with pytest.raises(InvalidArgumentError, match=match):
            copy_blocks(layers, [(0, 1)])


@pytest.mark.skipif(ON_GPU, reason="interpreter only")
def test_interpreted_copy_blocks_needs_host_caches():
    with pytest.raises(InvalidArgumentError, match="use CPU caches"):
        copy_blocks([torch.empty(4, 2, 8, 2, 64, device="meta")], [(0, 1)])


def test_runs_merge_consecutive_pairs():
    pairs = torch.tensor([[7, 1], [2, 5], [3, 6], [4, 7], [8, 3], [9, 2]])
    assert module._runs(pairs) == [[2, 5, 3], [7, 1, 1], [8, 3, 1], [9, 2, 1]]


@pytest.mark.parametrize("direction", ["out", "in"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_swap_blocks_matches_reference(make_cache, randn, assert_bitwise_equal, direction, dtype):
    device_cache = make_cache(6, 16, 2, 80, dtype, "padded")
    device_cache[2:] = randn(4, 2, 16, 2, 80, dtype=dtype)
    (host_cache,) = allocate_cpu_cache(1, 2, 80, num_blocks=5, dtype=dtype)
    host_cache.copy_(torch.randn(host_cache.shape))
    src, dst = (device_cache, host_cache) if direction == "out" else (host_cache, device_cache)
    mapping = [(1, 3), (2, 4), (4, 0), (0, 1)]  # a run (1, 3), (2, 4); (0, 1): a NaN block moves too
    expected = dst.clone()
    assert swap_blocks(src, dst, mapping) is dst
    swap_blocks_ref(src, expected, mapping)
    assert_bitwise_equal(dst, expected)


@pytest.mark.parametrize("dst_shape, dst_dtype, mapping, match", [
    ((4, 2, 16, 2, 64), torch.float32, [(0, 1)], "same block shape"),
    ((4, 2, 8, 2, 80), torch.float16, [(0, 1)], "dst has dtype float16; allowed: float32"),
    ((4, 2, 8, 2, 80), torch.float32, [(0, 1), (2, 1)], "dst block 1 appears more than once"),
    ((4, 2, 8, 2, 80), torch.float32, [(3, 4)], r"dst block 4; dst ids must be in \[0, 4\)"),
    ((4, 2, 8, 2, 80), torch.float32, [(6, 0)], r"src block 6; src ids must be in \[0, 6\)"),
])
def test_swap_blocks_rejects_and_copies_nothing(make_cache, assert_bitwise_equal, dst_shape, dst_dtype, mapping,
                                                match):
    src = make_cache(6, 8, 2, 80, torch.float32, fill=1.5)
    dst = torch.full(dst_shape, float("nan"), dtype=dst_dtype)
    before = dst.clone()
    with pytest.raises(InvalidArgumentError, match=match):
        swap_blocks(src, dst, mapping)
    assert_bitwise_equal(dst, before)


def test_swap_blocks_refuses_one_cache_as_both_sides(make_cache):
    cache = make_cache(6, 8, 2, 80, torch.float32)
    with pytest.raises(InvalidArgumentError, match="src and dst share memory"):
        swap_blocks(cache, cache[3:], [(0, 1)])
