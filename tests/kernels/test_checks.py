"""The shared launcher validation: good inputs pass (and return what launchers need), every kind of bad
input raises InvalidArgumentError with a message naming the problem."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlab.device import DEVICE, ON_GPU
from kvlab.errors import InvalidArgumentError
from kvlab.kernels import _checks as checks

# A second device that exists everywhere: tensors on it must be rejected next to DEVICE tensors.
OTHER_DEVICE = "meta"


def test_check_tensor_accepts_a_matching_tensor():
    checks.check_tensor(torch.zeros(2, 3), "x", ndim=2, dtypes=(torch.float32,), device="cpu")


@pytest.mark.parametrize("kwargs, bad, match", [
    ({"ndim": 2}, torch.zeros(2, 3, 4), "x must be 2-D, got shape"),
    ({"dtypes": (torch.float16,)}, torch.zeros(3), "x has dtype float32; allowed: float16"),
    ({"device": "cpu"}, torch.zeros(3, device=OTHER_DEVICE), "x is on meta but must be on cpu"),
    ({}, torch.zeros(4, 6)[:, ::2], "contiguous in its last dim"),
    ({}, [1.0, 2.0], "must be a torch.Tensor, got list"),
    ({}, torch.zeros(3, device="meta"), "x is a meta tensor .* kernels read and write real memory"),
])
def test_check_tensor_rejects(kwargs, bad, match):
    with pytest.raises(InvalidArgumentError, match=match):
        checks.check_tensor(bad, "x", **kwargs)


@pytest.mark.parametrize("layout", ["contiguous", "padded", "kv_major"])
def test_check_kv_cache_returns_geometry_for_any_strides(make_cache, layout):
    cache = make_cache(5, 16, 3, 80, torch.float16, layout)
    assert checks.check_kv_cache(cache) == (5, 16, 3, 80)


@pytest.mark.parametrize("block_size", checks.SUPPORTED_BLOCK_SIZES)
def test_check_kv_cache_accepts_every_power_of_two_block_size_up_to_128(block_size):
    assert checks.SUPPORTED_BLOCK_SIZES == (1, 2, 4, 8, 16, 32, 64, 128)
    assert checks.check_kv_cache(torch.zeros(3, 2, block_size, 1, 16, device=DEVICE)) == (3, block_size, 1, 16)


@pytest.mark.parametrize("head_dim", [16, 17, 24, 80, 96, 200, 255, 256])
def test_check_kv_cache_accepts_head_dims_from_16_to_256(head_dim):
    assert checks.check_kv_cache(torch.zeros(3, 2, 4, 1, head_dim, device=DEVICE)) == (3, 4, 1, head_dim)


ALLOWED_BLOCK_SIZES = "supported: 1, 2, 4, 8, 16, 32, 64, 128"


@pytest.mark.parametrize("shape, dtype, match", [
    ((5, 2, 16, 3), torch.float32, "must be 5-D"),
    ((5, 3, 16, 2, 64), torch.float32, r"dim 1 is 3, not 2"),
    ((5, 2, 12, 2, 64), torch.float32, f"block_size 12; {ALLOWED_BLOCK_SIZES}"),
    ((5, 2, 3, 2, 64), torch.float32, f"block_size 3; {ALLOWED_BLOCK_SIZES}"),
    ((5, 2, 256, 2, 64), torch.float32, f"block_size 256; {ALLOWED_BLOCK_SIZES}"),
    ((5, 2, 16, 2, 15), torch.float32, "head_dim 15; supported: any int from 16 to 256"),
    ((5, 2, 16, 2, 257), torch.float32, "head_dim 257; supported: any int from 16 to 256"),
    ((0, 2, 16, 2, 64), torch.float32, "at least one block"),
    ((5, 2, 16, 2, 64), torch.int32, "dtype int32; allowed: float32, float16, bfloat16"),
])
def test_check_kv_cache_rejects_bad_shapes_and_dtypes(shape, dtype, match):
    with pytest.raises(InvalidArgumentError, match=match):
        checks.check_kv_cache(torch.zeros(shape, dtype=dtype, device=DEVICE))


def test_check_kv_cache_rejects_aliased_slots():
    aliased = torch.zeros(1, 2, 1, 2, 64, device=DEVICE).expand(4, 2, 16, 2, 64)
    with pytest.raises(InvalidArgumentError, match="gives its blocks a zero stride"):
        checks.check_kv_cache(aliased)


@pytest.mark.parametrize("strides, what", [
    ((1000, 1024, 64, 32, 1), "blocks a stride of 1000, inside the 1024 elements"),  # block i+1 inside block i
    ((2048, 512, 64, 32, 1), "K and V halves a stride of 512, inside the 1024 elements"),  # V inside K
    ((2048, 1024, 48, 32, 1), "slots a stride of 48, inside the 64 elements"),  # slot j+1 inside slot j
])
def test_check_kv_cache_rejects_overlapping_strides(strides, what):
    cache = torch.zeros(8192, device=DEVICE).as_strided((4, 2, 16, 2, 32), strides)
    with pytest.raises(InvalidArgumentError, match=f"gives its {what} its smaller-stride dims span"):
        checks.check_kv_cache(cache)


def _offsets(shape, strides):
    """Every element's offset, by brute force."""
    return [sum(i * s for i, s in zip(index, strides)) for index in itertools.product(*map(range, shape))]


@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=4), data=st.data())
def test_check_no_overlap_rejects_every_tensor_whose_elements_share_memory(shape, data):
    strides = data.draw(st.lists(st.integers(0, 12), min_size=len(shape), max_size=len(shape)))
    t = torch.zeros(sum((n - 1) * s for n, s in zip(shape, strides)) + 1).as_strided(shape, strides)
    offsets = _offsets(shape, strides)
    if len(set(offsets)) < len(offsets):
        with pytest.raises(InvalidArgumentError, match="overlap in memory"):
            checks.check_no_overlap(t, "t", ["dim"] * len(shape))


@given(shape=st.lists(st.integers(1, 4), min_size=5, max_size=5), padding=st.integers(0, 3), data=st.data())
def test_check_no_overlap_accepts_every_permuted_and_padded_layout(shape, padding, data):
    order = data.draw(st.permutations(range(5)))
    storage = torch.zeros([shape[d] for d in order[:-1]] + [shape[order[-1]] + padding])
    t = storage[..., :shape[order[-1]]].permute([order.index(d) for d in range(5)])
    assert tuple(t.shape) == tuple(shape)
    checks.check_no_overlap(t, "t", checks.CACHE_DIM_NAMES)


def test_check_kv_cache_rejects_non_contiguous_head_dim():
    cache = torch.zeros(4, 2, 16, 2, 128, device=DEVICE)[..., ::2]
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        checks.check_kv_cache(cache)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's bf16 limitation only")
def test_bf16_is_rejected_for_arithmetic_in_the_interpreter_but_allowed_for_copies():
    cache = torch.zeros(4, 2, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="bfloat16, which the Triton interpreter"):
        checks.check_kv_cache(cache)
    assert checks.check_kv_cache(cache, arithmetic=False) == (4, 16, 2, 64)


@pytest.mark.skipif(not ON_GPU, reason="compiled kernels only")
def test_compiled_kernels_reject_host_caches():
    with pytest.raises(InvalidArgumentError, match="move it to cuda"):
        checks.check_kv_cache(torch.zeros(4, 2, 16, 2, 64))


def test_check_seq_lens_returns_the_longest():
    assert checks.check_seq_lens(torch.tensor([3, 9, 1], dtype=torch.int32), 3) == 9
    assert checks.check_seq_lens(torch.zeros(0, dtype=torch.int32), 0) == 0


@pytest.mark.parametrize("seq_lens, kwargs, match", [
    (torch.tensor([3, 9], dtype=torch.int64), {}, "dtype int64; allowed: int32"),
    (torch.tensor([3, 9, 4], dtype=torch.int32), {}, "3 entries but there are 2 sequences"),
    (torch.tensor([3, 0], dtype=torch.int32), {}, r"seq_lens\[1\] = 0; every sequence length must be >= 1"),
    (torch.tensor([3, 90], dtype=torch.int32), {"max_len": 64}, r"seq_lens\[1\] = 90; .* <= 64"),
])
def test_check_seq_lens_rejects(seq_lens, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        checks.check_seq_lens(seq_lens, 2, **kwargs)


def test_check_block_tables_ignores_unused_entries(random_block_tables):
    tables, seq_lens = random_block_tables([17, 1, 32], 16, num_blocks=6)
    assert (tables[1, 1:] < 0).any() or (tables[1, 1:] >= 6).any()  # junk past the used blocks
    checks.check_block_tables(tables, 3, 6, seq_lens, 16)


@pytest.mark.parametrize("bad_value", [-1, 6])
def test_check_block_tables_rejects_a_used_entry_out_of_range(random_block_tables, bad_value):
    tables, seq_lens = random_block_tables([17, 1, 32], 16, num_blocks=6)
    tables[2, 1] = bad_value
    with pytest.raises(InvalidArgumentError, match=rf"block_tables\[2, 1\] = {bad_value} .* \[0, 6\)"):
        checks.check_block_tables(tables, 3, 6, seq_lens, 16)


def test_check_block_tables_rejects_wrong_type_rows_and_width(random_block_tables):
    tables, seq_lens = random_block_tables([17, 40], 16, num_blocks=6, extra_columns=0)
    with pytest.raises(InvalidArgumentError, match="dtype int64; allowed: int32"):
        checks.check_block_tables(tables.long(), 2, 6, seq_lens, 16)
    with pytest.raises(InvalidArgumentError, match="2 rows but there are 3 sequences"):
        checks.check_block_tables(tables, 3, 6, torch.tensor([1, 1, 1], dtype=torch.int32, device=DEVICE), 16)
    with pytest.raises(InvalidArgumentError, match="only 3 columns; make it at least 4 wide"):
        checks.check_block_tables(tables, 2, 6, seq_lens + 16, 16)


def test_check_cu_query_lens():
    seq_lens = torch.tensor([5, 3, 8], dtype=torch.int32)
    checks.check_cu_query_lens(torch.tensor([0, 2, 5, 5], dtype=torch.int32), 3, 5, seq_lens)
    bad = {"start at 0 and end at the number of query rows": [1, 2, 5, 5],
           "decreases at sequence 1": [0, 4, 3, 5],
           r"sequence 1 has 4 query tokens but seq_lens\[1\] = 3": [0, 1, 5, 5]}
    for match, values in bad.items():
        with pytest.raises(InvalidArgumentError, match=match):
            checks.check_cu_query_lens(torch.tensor(values, dtype=torch.int32), 3, 5, seq_lens)


def test_check_query(make_cache):
    cache = make_cache(4, 16, 2, 64, torch.float32)
    assert checks.check_query(torch.zeros(3, 6, 64, device=DEVICE), cache) == 6
    with pytest.raises(InvalidArgumentError, match="head_dim 32 but the cache has 64"):
        checks.check_query(torch.zeros(3, 6, 32, device=DEVICE), cache)
    with pytest.raises(InvalidArgumentError, match="5 heads; it must be a positive multiple of the cache's 2"):
        checks.check_query(torch.zeros(3, 5, 64, device=DEVICE), cache)
    with pytest.raises(InvalidArgumentError, match="dtype float16"):
        checks.check_query(torch.zeros(3, 6, 64, dtype=torch.float16, device=DEVICE), cache)


def test_check_attention_options():
    assert checks.check_attention_options(0.125, 64, 30.0) == (0.125, 64, 30.0)
    assert checks.check_attention_options() == (None, None, None)
    normalised = checks.check_attention_options(np.float32(0.5), np.int64(7), 2)
    assert normalised == (0.5, 7, 2.0) and [type(v) for v in normalised] == [float, int, float]
    for kwargs, match in (({"scale": 0.0}, "scale must be a finite number > 0, got 0.0"),
                          ({"scale": float("inf")}, "scale"), ({"soft_cap": -1.0}, "soft_cap"),
                          ({"scale": True}, "got True"), ({"sliding_window": 0}, "sliding_window must be an int >= 1"),
                          ({"sliding_window": 2.5}, "got 2.5"), ({"sliding_window": True}, "got True")):
        with pytest.raises(InvalidArgumentError, match=match):
            checks.check_attention_options(**kwargs)


def test_check_slot_mapping_allows_many_skips():
    checks.check_slot_mapping(torch.tensor([-1, 7, -1, 0, -1]), 5, 8)


@pytest.mark.parametrize("slots, num_tokens, match", [
    (torch.tensor([1, 2, 3], dtype=torch.int32), 3, "dtype int32; allowed: int64"),
    (torch.tensor([1, -2, 3]), 3, r"slot_mapping\[1\] = -2; slots must be -1 \(skip\) or in \[0, 8\)"),
    (torch.tensor([1, 8, 3]), 3, r"slot_mapping\[1\] = 8"),
    (torch.tensor([5, -1, 2, 5]), 4, r"slot 5 is the target of tokens \[0, 3\]"),
    (torch.tensor([1, 2]), 3, "2 entries but there are 3 tokens"),
])
def test_check_slot_mapping_rejects(slots, num_tokens, match):
    with pytest.raises(InvalidArgumentError, match=match):
        checks.check_slot_mapping(slots, num_tokens, 8)


@pytest.mark.parametrize("mapping", [[(3, 1), (0, 2)], torch.tensor([[3, 1], [0, 2]], dtype=torch.int32),
                                     ((3, 1), (0, 2))])
def test_check_block_mapping_normalises_to_int64_pairs(mapping):
    pairs = checks.check_block_mapping(mapping, 4, 4, device=DEVICE, same_cache=True)
    assert pairs.dtype == torch.int64 and pairs.device.type == DEVICE.type
    assert pairs.tolist() == [[3, 1], [0, 2]]
    assert checks.check_block_mapping([], 4, 4, device=DEVICE, same_cache=True).shape == (0, 2)


@pytest.mark.parametrize("mapping, match", [
    ([(0, 1, 2)], r"\(src, dst\) pairs: .*; block_mapping\[0\] is \(0, 1, 2\)"),
    ([0, 1], r"\(src, dst\) pairs: .*; block_mapping\[0\] is 0"),
    (5, r"\(src, dst\) pairs: .*; got int"),
    (torch.tensor([[0.0, 1.0]]), "got float32 of shape"),
    ([(0, "x")], r"a list of int pairs .*; block_mapping\[0\] is \(0, 'x'\)"),
    ([(0, 1), (2.9, 3)], r"block_mapping\[1\] is \(2.9, 3\)"),  # torch.tensor would make it (2, 3)
    ([(True, 2)], r"block_mapping\[0\] is \(True, 2\)"),  # ... and this (1, 2)
    ([(0, 1), (2**70, 3)], r"block_mapping\[1\] is \(1180591620717411303424, 3\); block ids are int64"),
    (np.array([[0.0, 1.0]]), r"block_mapping\[0\] is array\(\[0., 1.\]\)"),
    (torch.tensor([[0, 1]], device="meta"), "block_mapping is a meta tensor"),
    ([(4, 1)], r"block_mapping\[0\] has src block 4; src ids must be in \[0, 4\)"),
    ([(0, 1), (2, -1)], r"block_mapping\[1\] has dst block -1"),
    ([(0, 1), (2, 1)], "dst block 1 appears more than once"),
    ([(0, 1), (1, 2)], "block 1 is both a src and a dst"),
])
def test_check_block_mapping_rejects(mapping, match):
    with pytest.raises(InvalidArgumentError, match=match):
        checks.check_block_mapping(mapping, 4, 4, device=DEVICE, same_cache=True)


def test_check_block_mapping_takes_numpy_int_pairs():
    pairs = checks.check_block_mapping(np.array([[3, 1], [0, 2]]), 4, 4, device="cpu", same_cache=True)
    assert pairs.dtype == torch.int64 and pairs.tolist() == [[3, 1], [0, 2]]


def test_block_mapping_between_two_caches_may_reuse_ids():
    pairs = checks.check_block_mapping([(0, 1), (1, 0)], 2, 3, device="cpu", same_cache=False)
    assert pairs.tolist() == [[0, 1], [1, 0]]


def test_a_device_without_index_matches_any_index_of_its_type():
    assert checks._same_device(torch.device("cuda", 0), torch.device("cuda"))
    assert not checks._same_device(torch.device("cuda", 1), torch.device("cuda", 0))
    assert not checks._same_device(torch.device("cpu"), torch.device("cuda"))
