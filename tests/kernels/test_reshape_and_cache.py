"""reshape_and_cache against the reference: written slots match bit for bit, every other slot keeps its
NaN poison, and bad input raises before anything is written."""

import importlib

import pytest
import torch

from kvlab.device import DEVICE, ON_GPU
from kvlab.errors import InvalidArgumentError
from kvlab.kernels._checks import SUPPORTED_BLOCK_SIZES
from kvlab.kernels.reference import reshape_and_cache_ref
from kvlab.kernels.reshape_and_cache import reshape_and_cache

# The module; kvlab.kernels.reshape_and_cache is the function.
module = importlib.import_module("kvlab.kernels.reshape_and_cache")

# A pure copy: bf16 bits move exactly in the interpreter.
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(ON_GPU and not torch.cuda.is_bf16_supported(),
                                                             reason="this GPU has no bf16"))
DTYPES = [torch.float32, torch.float16, BF16]


def run_and_compare(make_cache, randn, random_slot_mapping, assert_bitwise_equal, *, num_tokens, num_blocks,
                    block_size, num_kv_heads, head_dim, dtype, layout="contiguous", num_skipped=2):
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, layout)
    expected = cache.clone()
    # key/value as slices of one fused qkv projection output: strided rows, contiguous last dim.
    qkv = randn(num_tokens, 3 * num_kv_heads, head_dim, dtype=dtype)
    key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    slots = random_slot_mapping(num_tokens, num_blocks * block_size, num_skipped)

    assert reshape_and_cache(key, value, cache, slots) is cache
    reshape_and_cache_ref(key, value, expected, slots)
    assert_bitwise_equal(cache, expected)
    return cache, slots


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("layout", ["contiguous", "padded", "kv_major"])
@pytest.mark.parametrize("block_size, head_dim", [(8, 80), (16, 64), (32, 128)])
def test_matches_reference(make_cache, randn, random_slot_mapping, assert_bitwise_equal, dtype, layout,
                           block_size, head_dim):
    run_and_compare(make_cache, randn, random_slot_mapping, assert_bitwise_equal, num_tokens=13, num_blocks=5,
                    block_size=block_size, num_kv_heads=3, head_dim=head_dim, dtype=dtype, layout=layout)


# The ends of the supported range, and padded ones (on tiles of 32, 128, 256).
HEAD_DIMS = (16, 17, 64, 80, 128, 200, 256)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", SUPPORTED_BLOCK_SIZES)
def test_every_supported_geometry(make_cache, randn, random_slot_mapping, assert_bitwise_equal, block_size,
                                  head_dim):
    # At least 8 slots: room for the 5 tokens and for slots that must keep their NaN.
    run_and_compare(make_cache, randn, random_slot_mapping, assert_bitwise_equal, num_tokens=5,
                    num_blocks=max(3, 8 // block_size), block_size=block_size, num_kv_heads=1, head_dim=head_dim,
                    dtype=torch.float16, num_skipped=1)


def test_only_the_mapped_slots_change(make_cache, randn, random_slot_mapping, assert_bitwise_equal):
    cache, slots = run_and_compare(make_cache, randn, random_slot_mapping, assert_bitwise_equal, num_tokens=9,
                                   num_blocks=4, block_size=8, num_kv_heads=2, head_dim=80, dtype=torch.float32,
                                   num_skipped=3)
    written = torch.zeros(4 * 8, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    per_slot = cache.transpose(1, 2).reshape(4 * 8, -1)  # [slot, K and V of every head]
    assert not per_slot[written].isnan().any()
    assert per_slot[~written].isnan().all()


def test_heads_split_over_several_programs(make_cache, randn, random_slot_mapping, assert_bitwise_equal,
                                           monkeypatch):
    # A tile cap below one head's width makes every head its own program (grid axis 1).
    monkeypatch.setattr(module, "MAX_TILE_ELEMENTS", 64)
    run_and_compare(make_cache, randn, random_slot_mapping, assert_bitwise_equal, num_tokens=6, num_blocks=3,
                    block_size=8, num_kv_heads=5, head_dim=80, dtype=torch.float16, layout="padded")


def test_all_skipped_and_empty_inputs_write_nothing(make_cache, randn, assert_bitwise_equal):
    cache = make_cache(2, 8, 2, 64, torch.float32)
    before = cache.clone()
    key, value = randn(3, 2, 64), randn(3, 2, 64)
    reshape_and_cache(key, value, cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    reshape_and_cache(key[:0], value[:0], cache, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert_bitwise_equal(cache, before)


BAD_INPUTS = ["key dtype", "key ndim", "key heads", "value tokens", "key strided dim", "key device", "slot dtype",
              "slot device", "slot range", "slot below -1", "duplicate slot", "slot count", "cache block size",
              "cache head_dim", "cache layout"]


def _bad_input(name, randn):
    """(key, value, slot_mapping, cache shape or None for the default cache, expected message) for a bad
    3-token write into a [4, 2, 8, 2, 64] float32 cache."""
    key, value = randn(3, 2, 64), randn(3, 2, 64)
    slots = torch.tensor([0, 9, -1], device=DEVICE)
    return {
        "key dtype": (key.half(), value, slots, None, "key has dtype float16; allowed: float32"),
        "key ndim": (key.flatten(1), value, slots, None, "key must be 3-D"),
        "key heads": (randn(3, 4, 64), value, slots, None,
                      r"key has shape \(3, 4, 64\); it must be \[num_tokens, 2, 64\]"),
        "value tokens": (key, randn(4, 2, 64), slots, None, "key has 3 tokens but value has 4"),
        "key strided dim": (randn(3, 2, 128)[..., ::2], value, slots, None, "key must be contiguous in its last dim"),
        "key device": (key.to("meta"), value, slots, None, "key is on meta but must be on"),
        "slot dtype": (key, value, slots.int(), None, "slot_mapping has dtype int32; allowed: int64"),
        "slot device": (key, value, slots.to("meta"), None, "slot_mapping is on meta"),
        "slot range": (key, value, torch.tensor([0, 32, 1], device=DEVICE), None, r"slot_mapping\[1\] = 32"),
        "slot below -1": (key, value, torch.tensor([0, -5, 1], device=DEVICE), None, r"slot_mapping\[1\] = -5"),
        "duplicate slot": (key, value, torch.tensor([7, 3, 7], device=DEVICE), None, "slot 7 is the target of tokens"),
        "slot count": (key, value, slots[:2], None, "slot_mapping has 2 entries but there are 3 tokens"),
        "cache block size": (key, value, slots, (2, 2, 12, 2, 64),
                             "block_size 12; supported: 1, 2, 4, 8, 16, 32, 64, 128"),
        "cache head_dim": (key[..., :8], value[..., :8], slots, (4, 2, 8, 2, 8),
                           "head_dim 8; supported: any int from 16 to 256"),
        "cache layout": (key, value, slots, (4, 8, 2, 2, 64), "dim 1 is 8, not 2"),
    }[name]


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_raises_and_writes_nothing(make_cache, randn, assert_bitwise_equal, name):
    key, value, slots, cache_shape, match = _bad_input(name, randn)
    cache = make_cache(4, 8, 2, 64, torch.float32) if cache_shape is None else \
        torch.full(cache_shape, float("nan"), device=DEVICE)
    before = cache.clone()
    with pytest.raises(InvalidArgumentError, match=match):
        reshape_and_cache(key, value, cache, slots)
    assert_bitwise_equal(cache, before)


def test_cache_must_be_a_tensor(randn):
    with pytest.raises(InvalidArgumentError, match="kv_cache must be a torch.Tensor"):
        reshape_and_cache(randn(1, 2, 64), randn(1, 2, 64), [0.0], torch.tensor([0], device=DEVICE))


def test_meta_tensors_raise_instead_of_a_torch_traceback(randn):
    key, value = randn(3, 2, 64).to("meta"), randn(3, 2, 64).to("meta")
    cache = torch.empty(4, 2, 8, 2, 64, device="meta")
    with pytest.raises(InvalidArgumentError, match="kv_cache is a meta tensor .* real memory"):
        reshape_and_cache(key, value, cache, torch.tensor([0, 9, -1], device="meta"))


@pytest.mark.parametrize("strides", [(512, 256, 32, 64, 1), (200, 256, 64, 32, 1)],
                         ids=["slot-step-inside-a-head", "block-step-inside-a-block"])
def test_a_cache_with_overlapping_strides_raises_and_writes_nothing(randn, strides):
    # Views of one NaN buffer where different slots share memory: two tokens' writes would land on each other.
    storage = torch.full((4096,), float("nan"), device=DEVICE)
    cache = storage.as_strided((4, 2, 8, 2, 64), strides)
    with pytest.raises(InvalidArgumentError, match="overlap in memory"):
        reshape_and_cache(randn(3, 2, 64), randn(3, 2, 64), cache, torch.tensor([0, 9, 17], device=DEVICE))
    assert storage.isnan().all()
