"""copy_blocks (every layer in one launch) and swap_blocks against the reference, bit for bit; bad input raises
before anything is copied."""

import importlib

import pytest
import torch

from kvlab.device import DEVICE, ON_GPU
from kvlab.errors import InvalidArgumentError
from kvlab.kernels.cache import allocate_cpu_cache, allocate_kv_cache
from kvlab.kernels.copy_blocks import copy_blocks, swap_blocks
from kvlab.kernels.reference import copy_blocks_ref, swap_blocks_ref

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
def test_copy_blocks_matches_reference(make_cache, randn, assert_bitwise_equal, dtype, layout):
    layers = poisoned_layers(make_cache, randn, 3, 7, 8, 3, 80, dtype, layout)
    copy_and_compare(layers, [(5, 2), (0, 6), (3, 1)], assert_bitwise_equal)  # (0, 6): block 6 becomes NaN


# Every block size, with head dims across the supported range (16 to 256; 17, 48, 80 and 200 on padded tiles).
# (The interpreter's cost grows with block_size: the kernel loops over a block's slots.)
GEOMETRIES = [(1, 16, torch.float32, "kv_major"), (2, 17, torch.float16, "padded"),
              (4, 200, torch.float32, "contiguous"), (8, 16, torch.float16, "contiguous"),
              (16, 256, torch.float16, "kv_major"), (16, 64, torch.float32, "padded"),
              (32, 128, torch.float16, "padded"), (32, 17, torch.float32, "contiguous"),
              (64, 48, torch.float16, "padded"), (128, 16, torch.float32, "kv_major")]


@pytest.mark.parametrize("block_size, head_dim, dtype, layout", GEOMETRIES,
                         ids=[f"b{b}-d{d}-{str(t).removeprefix('torch.')}-{layout}" for b, d, t, layout in GEOMETRIES])
def test_copy_blocks_every_block_size(make_cache, randn, assert_bitwise_equal, block_size, head_dim, dtype, layout):
    layers = poisoned_layers(make_cache, randn, 2, 5, block_size, 1, head_dim, dtype, layout)
    copy_and_compare(layers, [(3, 1), (0, 4)], assert_bitwise_equal)


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
    "float ids": ([(1, 2), (3.7, 0)], r"int pairs .*; block_mapping\[1\] is \(3.7, 0\)"),
    "integral float ids": ([(1.0, 2.0)], r"block_mapping\[0\] is \(1.0, 2.0\)"),
    "bool ids": ([(True, False)], r"block_mapping\[0\] is \(True, False\)"),
    "bool tensor": (torch.tensor([[True, False]]), "got bool of shape"),
    "meta tensor": (torch.tensor([[1, 2]], device="meta"), "block_mapping is a meta tensor"),
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
        ([make_cache(4, 8, 2, 12, torch.float32)], "head_dim 12; supported: any int from 16 to 256"),
        ([make_cache(4, 256, 2, 64, torch.float32)], "block_size 256; supported: 1, 2, 4, 8, 16, 32, 64, 128"),
    ]
    for layers, match in cases:
        with pytest.raises(InvalidArgumentError, match=match):
            copy_blocks(layers, [(0, 1)])


@pytest.mark.skipif(ON_GPU or not torch.cuda.is_available(), reason="the interpreter forced on a CUDA machine only")
def test_interpreted_copy_blocks_needs_host_caches():
    with pytest.raises(InvalidArgumentError, match="use CPU caches"):
        copy_blocks([torch.empty(4, 2, 8, 2, 64, device="cuda")], [(0, 1)])


def test_copy_blocks_on_meta_caches_raises():
    with pytest.raises(InvalidArgumentError, match=r"kv_caches\[0\] is a meta tensor .* real memory"):
        copy_blocks([torch.empty(4, 2, 8, 2, 64, device="meta")] * 2, torch.tensor([[0, 1]], device="meta"))


def test_copy_blocks_on_overlapping_caches_raises_and_copies_nothing(randn):
    # Block i + 1 starts inside block i (block stride 600 < the 1024 elements a block spans).
    storage = randn(2, 4096)
    layers = [layer.as_strided((4, 2, 8, 2, 32), (600, 512, 64, 32, 1)) for layer in storage]
    before = storage.clone()
    with pytest.raises(InvalidArgumentError, match=r"kv_caches\[0\] .* gives its blocks a stride of 600"):
        copy_blocks(layers, [(0, 3)])
    assert torch.equal(storage, before)


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


@pytest.mark.parametrize("block_size, head_dim", [(1, 16), (128, 17)])
def test_swap_blocks_every_block_size(make_cache, randn, assert_bitwise_equal, block_size, head_dim):
    src = make_cache(4, block_size, 1, head_dim, torch.float16, "padded")
    src[1:] = randn(3, 2, block_size, 1, head_dim, dtype=torch.float16)
    dst = make_cache(3, block_size, 1, head_dim, torch.float16)
    expected = dst.clone()
    swap_blocks(src, dst, [(3, 0), (0, 2)])
    assert_bitwise_equal(dst, swap_blocks_ref(src, expected, [(3, 0), (0, 2)]))


@pytest.mark.parametrize("mapping, match", [
    ([(0, 1.5)], r"block_mapping\[0\] is \(0, 1.5\)"),
    ([(1, 0), (False, True)], r"block_mapping\[1\] is \(False, True\)"),
])
def test_swap_blocks_rejects_non_int_ids_and_copies_nothing(make_cache, assert_bitwise_equal, mapping, match):
    src, dst = make_cache(3, 8, 2, 16, torch.float32, fill=1.5), make_cache(3, 8, 2, 16, torch.float32)
    before = dst.clone()
    with pytest.raises(InvalidArgumentError, match=match):
        swap_blocks(src, dst, mapping)
    assert_bitwise_equal(dst, before)


def test_swap_blocks_on_meta_caches_raises():
    src, dst = (torch.empty(3, 2, 8, 2, 16, device="meta") for _ in range(2))
    with pytest.raises(InvalidArgumentError, match="src is a meta tensor .* real memory"):
        swap_blocks(src, dst, [(0, 1)])


def test_swap_blocks_into_an_overlapping_cache_raises_and_copies_nothing(make_cache):
    src = make_cache(3, 8, 2, 16, torch.float32, fill=1.5)
    storage = torch.full((1024,), float("nan"))
    dst = storage.as_strided((3, 2, 8, 2, 16), (256, 200, 32, 16, 1))  # V starts inside K
    with pytest.raises(InvalidArgumentError, match="dst .* gives its K and V halves a stride of 200"):
        swap_blocks(src, dst, [(0, 1)])
    assert storage.isnan().all()


def test_swap_blocks_refuses_one_cache_as_both_sides(make_cache):
    cache = make_cache(6, 8, 2, 80, torch.float32)
    with pytest.raises(InvalidArgumentError, match="src and dst share memory"):
        swap_blocks(cache, cache[3:], [(0, 1)])
