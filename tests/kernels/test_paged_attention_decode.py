"""paged_attention_decode against kvlab.kernels.reference on NaN-poisoned caches: GQA ratios 1/3/4/8, every supported
block size (1 to 128), head dims from 16 to 256 incl. padded ones (17, 48, 80, 200, 255), split-K off/on/auto,
sliding window, soft cap, strided inputs; bad input raises."""

import importlib

import pytest
import torch
from attention_cases import CONFIGS, F16, F32, GEOMETRIES, assert_close, build_case, strided_block_tables

from kvlab.device import DEVICE, ON_GPU
from kvlab.errors import InvalidArgumentError
from kvlab.kernels.paged_attention_decode import (MAX_PARTITIONS, MIN_PARTITION_TOKENS, choose_num_partitions,
                                                  paged_attention_decode)
from kvlab.kernels.reference import paged_attention_decode_ref
from kvlab.kernels.split_k_reduce import split_k_reduce

# The module; kvlab.kernels.paged_attention_decode is the function.
module = importlib.import_module("kvlab.kernels.paged_attention_decode")

# 1-token sequence, lengths that are and are not block multiples; 70 tokens cross several tiles and blocks.
SEQ_LENS = [37, 1, 70, 16]


@pytest.fixture
def case(make_cache, random_block_tables):
    return lambda **kwargs: build_case(make_cache, random_block_tables, **kwargs)


@pytest.mark.parametrize("split_k", [False, 3], ids=["no-split", "split3"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size, dtype, layout", CONFIGS)
def test_matches_reference(case, num_heads, num_kv_heads, head_dim, block_size, dtype, layout, split_k):
    c = case(seq_lens=SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
             block_size=block_size, dtype=dtype, layout=layout, strided_query=layout != "contiguous")
    out = paged_attention_decode(*c.args(), split_k=split_k)
    assert_close(out, paged_attention_decode_ref(*c.args()))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size, dtype, layout", GEOMETRIES)
def test_every_block_size_and_head_dim_range(case, num_heads, num_kv_heads, head_dim, block_size, dtype, layout):
    c = case(seq_lens=SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
             block_size=block_size, dtype=dtype, layout=layout, strided_query=True)
    expected = paged_attention_decode_ref(*c.args())
    for split_k in (False, 3):
        assert_close(paged_attention_decode(*c.args(), split_k=split_k), expected)


@pytest.mark.skipif(not (ON_GPU and torch.cuda.is_bf16_supported()), reason="bf16 needs a GPU that supports it")
@pytest.mark.parametrize("split_k", [False, 3])
def test_bf16_on_gpu(case, split_k):
    c = case(seq_lens=SEQ_LENS, num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16)
    assert_close(paged_attention_decode(*c.args(), split_k=split_k), paged_attention_decode_ref(*c.args()))


def test_every_split_choice_gives_the_same_answer(case):
    # 5 partitions of a 70-token context (5 tiles on CPU) plus a 1-token sequence: many partitions are empty.
    c = case(seq_lens=[70, 1, 45], num_heads=4, num_kv_heads=1, head_dim=64, block_size=8, dtype=F32)
    expected = paged_attention_decode_ref(*c.args())
    outs = {split_k: paged_attention_decode(*c.args(), split_k=split_k) for split_k in (None, False, True, 1, 2, 5)}
    for out in outs.values():
        assert_close(out, expected)
        torch.testing.assert_close(out, outs[False], atol=1e-5, rtol=1e-5)


def test_auto_splits_when_the_device_looks_idle(case, monkeypatch):
    # On CPU auto never splits (one program runs at a time); pretend to be a wide GPU to exercise it.
    monkeypatch.setattr(module, "compute_units", lambda device: 64)
    monkeypatch.setattr(module, "MIN_PARTITION_TOKENS", 16)
    reduced = []
    monkeypatch.setattr(module, "split_k_reduce", lambda out, *partials: reduced.append(partials[0].shape[2])
                        or split_k_reduce(out, *partials))
    c = case(seq_lens=[70, 1, 45], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16, dtype=F32)
    out = paged_attention_decode(*c.args())
    assert reduced == [70 // 16]  # partitions: limited by the context length, not by the 64 "SMs"
    assert_close(out, paged_attention_decode_ref(*c.args()))


@pytest.mark.parametrize("split_k", [False, 2], ids=["no-split", "split2"])
@pytest.mark.parametrize("sliding_window, soft_cap, scale", [
    (1, None, None), (5, None, None), (20, None, None), (500, None, None),
    (None, 2.0, None), (None, 30.0, 0.5), (7, 1.5, 0.3)])
def test_window_soft_cap_and_scale(case, sliding_window, soft_cap, scale, split_k):
    c = case(seq_lens=SEQ_LENS, num_heads=8, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    options = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    out = paged_attention_decode(*c.args(), split_k=split_k, **options)
    assert_close(out, paged_attention_decode_ref(*c.args(), **options))


@pytest.mark.parametrize("split_k", [False, 2])
def test_blocks_before_the_window_are_never_read(case, split_k):
    # A block manager may drop blocks that slid out of the window. Point those table entries at an all-NaN
    # spare block: if the kernel touched them (or even masked them after reading), NaN would leak.
    block_size, window = 8, 10
    c = case(seq_lens=[61, 40], num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size, dtype=F16)
    expected = paged_attention_decode_ref(*c.args(), sliding_window=window)
    used = {int(b) for s, n in enumerate(c.seq_lens.tolist()) for b in c.block_tables[s, :-(-n // block_size)]}
    spare = next(b for b in range(c.kv_cache.shape[0]) if b not in used)
    for s, n in enumerate(c.seq_lens.tolist()):
        c.block_tables[s, :(n - window) // block_size] = spare  # blocks wholly before the window
    out = paged_attention_decode(*c.args(), sliding_window=window, split_k=split_k)
    assert_close(out, expected)


def test_strided_block_tables(case):
    c = case(seq_lens=[29, 3], num_heads=2, num_kv_heads=1, head_dim=80, block_size=8, dtype=F32)
    out = paged_attention_decode(c.query, c.kv_cache, strided_block_tables(c.block_tables), c.seq_lens, split_k=2)
    assert_close(out, paged_attention_decode_ref(*c.args()))


def test_empty_batch(case):
    c = case(seq_lens=[5], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8, dtype=F32)
    out = paged_attention_decode(c.query[:0], c.kv_cache, c.block_tables[:0], c.seq_lens[:0])
    assert out.shape == (0, 2, 64)


# ---- split-K heuristic (pure function: the SM count is an argument) ----------------------------------------

def test_heuristic_does_not_split_a_full_grid_or_a_short_context():
    assert choose_num_partitions(num_seqs=256, num_kv_heads=8, context_len=32768, num_sms=132) == 1
    assert choose_num_partitions(num_seqs=1, num_kv_heads=8, context_len=MIN_PARTITION_TOKENS - 1, num_sms=132) == 1
    assert choose_num_partitions(num_seqs=1, num_kv_heads=1, context_len=100_000, num_sms=1) == 1  # interpreter


def test_heuristic_splits_long_contexts_on_an_idle_gpu():
    # 8 programs on 132 SMs: split to about 2 programs per SM, but no partition shorter than the minimum.
    assert choose_num_partitions(num_seqs=1, num_kv_heads=8, context_len=32768, num_sms=132) == 33
    assert (choose_num_partitions(num_seqs=1, num_kv_heads=8, context_len=2048, num_sms=132)
            == 2048 // MIN_PARTITION_TOKENS)
    assert choose_num_partitions(num_seqs=1, num_kv_heads=1, context_len=10**7, num_sms=1000) == MAX_PARTITIONS


# ---- launcher errors: bad input raises InvalidArgumentError naming the problem -------------------------------

def _bad(c, name):
    """(args, kwargs) for paged_attention_decode with one thing wrong; c holds 2 sequences [13, 6]."""
    q, cache, tables, lens = c.args()
    other = torch.empty(0, device="meta")
    changes = {
        "query ndim": ((q[0], cache, tables, lens), {}),
        "query dtype": ((q.to(torch.float16), cache, tables, lens), {}),
        "query device": ((q.to("meta"), cache, tables, lens), {}),
        "query strided last dim": ((q.repeat_interleave(2, -1)[..., ::2], cache, tables, lens), {}),
        "heads not a multiple": ((q[:, :3], cache, tables, lens), {}),
        "head_dim mismatch": ((q[..., :32], cache, tables, lens), {}),
        "cache not K/V pairs": ((q, cache[:, :1], tables, lens), {}),
        "table dtype": ((q, cache, tables.long(), lens), {}),
        "table device": ((q, cache, tables.to("meta"), lens), {}),
        "block id too big": ((q, cache, torch.where(tables == tables[0, 0], cache.shape[0], tables), lens), {}),
        "block id negative": ((q, cache, torch.where(tables == tables[1, 0], -1, tables), lens), {}),
        "seq_len 0": ((q, cache, tables, torch.tensor([13, 0], dtype=torch.int32, device=DEVICE)), {}),
        "seq_len over capacity": ((q, cache, tables, lens + 8 * tables.shape[1]), {}),
        "seq_lens dtype": ((q, cache, tables, lens.long()), {}),
        "seq_lens count": ((q, cache, tables, lens[:1]), {}),
        "seq_lens device": ((q, cache, tables, other.int()), {}),
        "split_k zero": ((q, cache, tables, lens), {"split_k": 0}),
        "split_k string": ((q, cache, tables, lens), {"split_k": "yes"}),
        "window zero": ((q, cache, tables, lens), {"sliding_window": 0}),
        "soft_cap negative": ((q, cache, tables, lens), {"soft_cap": -1.0}),
        "scale nan": ((q, cache, tables, lens), {"scale": float("nan")}),
    }
    return changes[name]


BAD = ["query ndim", "query dtype", "query device", "query strided last dim", "heads not a multiple",
       "head_dim mismatch", "cache not K/V pairs", "table dtype", "table device", "block id too big",
       "block id negative", "seq_len 0", "seq_len over capacity", "seq_lens dtype", "seq_lens count",
       "seq_lens device", "split_k zero", "split_k string", "window zero", "soft_cap negative", "scale nan"]


@pytest.mark.parametrize("name", BAD)
def test_bad_input_raises(case, name):
    c = case(seq_lens=[13, 6], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    args, kwargs = _bad(c, name)
    with pytest.raises(InvalidArgumentError):
        paged_attention_decode(*args, **kwargs)


def test_meta_tensors_raise_instead_of_a_torch_traceback(case):
    # Meta tensors have shapes but no memory: the launcher must say so, not crash reading seq_lens.
    c = case(seq_lens=[13, 6], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    with pytest.raises(InvalidArgumentError, match="kv_cache is a meta tensor .* real memory"):
        paged_attention_decode(*(t.to("meta") for t in c.args()))


def test_a_cache_with_overlapping_blocks_raises(case):
    c = case(seq_lens=[13, 6], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    q, cache, tables, lens = c.args()
    # Block i + 1 starts a little past the middle of block i, inside its V half.
    overlapping = cache.as_strided(cache.shape, (cache.stride(0) // 2 + 8, *cache.stride()[1:]))
    with pytest.raises(InvalidArgumentError, match="gives its blocks a stride of .* overlap in memory"):
        paged_attention_decode(q, overlapping, tables, lens)


def test_bad_input_messages_say_what_is_allowed(case):
    c = case(seq_lens=[13, 6], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    for name, match in [("seq_len 0", "must be >= 1"), ("block id too big", r"must be in \[0, "),
                        ("seq_len over capacity", "columns"), ("split_k zero", "number of partitions"),
                        ("heads not a multiple", "multiple of")]:
        args, kwargs = _bad(c, name)
        with pytest.raises(InvalidArgumentError, match=match):
            paged_attention_decode(*args, **kwargs)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's bf16 limitation only applies on CPU")
def test_bf16_is_rejected_on_cpu(case):
    c = case(seq_lens=[5], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8, dtype=F32)
    q, cache, tables, lens = c.args()
    with pytest.raises(InvalidArgumentError, match="bfloat16"):
        paged_attention_decode(q.bfloat16(), cache.bfloat16(), tables, lens)
